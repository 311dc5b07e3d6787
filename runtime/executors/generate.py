"""The ``generate`` node's executor: a generation engine behind the node's sampling settings.

Owns the mapping from a generate node of the plan to an engine (``engine="embedded"``:
``runtime.engines.generation.GenerationEngine``; ``"vllm"``: ``runtime.engines.vllm_engine``)
and from a prompt group to engine requests and back to trajectories. The replica loop
(``runtime.workers.run_generation_replica``) drives it: ``submit`` groups, ``step`` the
engine, ``update_weights`` between steps. It must not admit or route groups.

Empty responses are rejected: a response with no token (the embedded engine always gives
at least one, EOS included, so only an engine fault or a vLLM corner produces one) has no
log-prob to train, yet its reward would shift its group's baseline. It is left out of its
group (a group left empty is resampled), counted (``empty_responses`` in the replica's
counts) and logged once; more than half of the last 200 responses empty stops the run
(``areal_flow.rewards.pool.FailureMonitor``).

Weight updates (``gen.interruptible``, node attribute ``interruptible``): by default the
engine pauses in-flight sequences, loads the new version and resumes them (the
"interruptible rollout worker" of Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
Reinforcement Learning System for Language Reasoning"). With ``interruptible=False`` the
executor queues new requests itself, admitting them only into free engine slots, and an
update first steps the engine until every sequence holding a slot has finished with the
old weights (no new one is admitted meanwhile), then loads; the groups finished during
that drain come out of the next :meth:`GenerateExecutor.step`. The drain runs inside the
replica's weight ``load`` span.

Prompt budget: the plan's memory and time figures assume prompts of at most
``compile.max_prompt_len`` tokens (``plan.workload["prompt_len"]``). Longer prompts still run
(the engine sizes its cache to what it gets), but the plan's figures no longer hold: the first
one is said on stderr with its length and the key to raise, and the replica's report counts
them (``prompts_over_budget``, ``longest_prompt``, in ``summary.json``).

Correctness: each trajectory's ``correct`` is the dataset task's judgment of its response
(``correct(output_text, answer)``, :func:`answer_judge`), whatever its reward becomes
(a penalty, a reward model, a user op): the run's accuracy counts right answers.

Occupancy: :meth:`GenerateExecutor.occupancy` gives the rows the last engine step decoded
and the engine's slots; the replica writes both into each engine-step span of the trace
(``args.rows``, ``args.slots``).

A request the engine refuses (``submit`` raises ``RequestRefused`` for that one request: a
prompt as long as the context, invalid sampling settings) fails that sample only, like a
failed reward: the sample is
left out of its group (a group left empty is resampled), counted (``generation_errors``),
logged once per exception type with its traceback, and the worker lives on. Empty responses
and generation errors share one monitor: the run stops with one line when more than
``reward.max_failure_fraction`` (node attribute ``max_failure_fraction``) of the last
``reward.failure_window`` responses failed. Any other exception of the engine is not a
refused request but a fault of the engine or of this code, and the replica stops: a
programming error (``runtime.executors.bugs``) with one line naming the node, anything else
(out of memory, a CUDA fault) with its traceback.
"""

from __future__ import annotations

import sys
import traceback
from collections import deque
from typing import Callable

from areal_flow.tasks.catalog import build_task
from areal_flow.ops.generate import encode_prompt
from areal_flow.rewards.pool import FailureMonitor, Outcome
from areal_flow.types import Trajectory
from areal_flow.values import Prompt, Rollouts
from runtime.engines.generation import GenerationRequest, GenerationResult, RequestRefused, SamplingParams
from runtime.executors.bugs import PROGRAMMING_ERRORS, programming_error


EMPTY = "empty response"
EMPTY_MAX_FRACTION, EMPTY_WINDOW = 0.5, 200  # stop when more than half of the last 200 responses were empty


class EngineRefused(ValueError):
    """The node's settings ask for something its engine cannot do (named)."""


class GenerateExecutor:
    """Grain ``stream``: groups in, finished groups out, at the engine's pace (an
    ``areal_flow.ops.interfaces.StreamExecutor`` over an ``Engine``).

    Args:
        node: the plan's generate node (``n_samples``, ``max_new_tokens``, ``temperature``,
            ``top_p``, ``chat_template``, ``engine``, ``max_batch_size``) and its planned ``concurrent``
            sequences per replica (the engine gets the smaller of the two as slots).
        ctx: the replica's :class:`runtime.context.WorkerContext`.

    Raises:
        EngineRefused: ``engine="vllm"`` with ``top_p < 1`` (vLLM reports the nucleus-
            renormalised log-prob, so the importance ratio would silently become one of
            the kept mass; see ``runtime.engines.vllm_engine``).
    """

    def __init__(self, node, ctx) -> None:
        self.node, self.attrs = node, node.attrs
        self.engine = build_engine(node, ctx)
        self.params = sampling_params(node)
        self.tokenizer = ctx.tokenizer
        self.judge = answer_judge(getattr(ctx, "plan", None))
        self._groups: dict[tuple[int, int], dict] = {}
        self.interruptible = bool(self.attrs.get("interruptible", True))
        self._queue: deque[GenerationRequest] = deque()  # not interruptible: requests not yet in the engine
        self._finished: list[tuple[int, int, Rollouts]] = []  # groups complete, not yet returned
        self._last_rows = 0
        self.counts = {"empty_responses": 0, "generation_errors": 0}
        self.budget = PromptBudget(node, (getattr(getattr(ctx, "plan", None), "workload", None) or {})
                                   .get("prompt_len"))
        self.monitor = FailureMonitor(f"generate node '{node.name}'", self.attrs.get("max_failure_fraction",
                                      EMPTY_MAX_FRACTION), self.attrs.get("failure_window", EMPTY_WINDOW))

    @property
    def version(self) -> int:
        return self.engine.version

    def submit(self, index: int, attempt: int, problem: Prompt) -> None:
        """Start the ``n_samples`` responses of prompt group ``index`` (its ``attempt``-th prompt)."""
        ids = encode_prompt(self.tokenizer, problem["prompt"], self.attrs.get("chat_template"))
        self.budget.check(len(ids))
        tag = "" if attempt == 1 else f"/{attempt}"
        self._groups[(index, attempt)] = {"problem": problem, "results": [], "failed": 0}
        for j in range(self.attrs["n_samples"]):
            request = GenerationRequest(f"{index}:{j}{tag}", ids, self.params,
                                        {"group": index, "attempt": attempt, "sample": j})
            if self.interruptible:
                self._submit(request)
            else:
                self._queue.append(request)

    def _submit(self, request: GenerationRequest) -> None:
        """Hand ``request`` to the engine; a refusal fails that sample only (module doc)."""
        try:
            self.engine.submit(request)
        except PROGRAMMING_ERRORS as exc:  # a bug is no failed sample (runtime.executors.bugs)
            raise programming_error(f"generate node '{self.node.name}'", exc) from exc
        except RequestRefused as exc:  # any other engine fault propagates: the replica stops
            key = (request.meta["group"], request.meta["attempt"])
            self.counts["generation_errors"] += 1
            self._groups[key]["failed"] += 1
            self.monitor.record(Outcome(kind=f"generation error ({type(exc).__name__})",
                                        detail=traceback.format_exc()), request.request_id)
            self._collect(key)

    def _record(self, results: list[GenerationResult]) -> None:
        for result in results:
            key = (result.meta["group"], result.meta["attempt"])
            self._groups[key]["results"].append(result)
            self._collect(key)

    def _collect(self, key: tuple[int, int]) -> None:
        """Move group ``key`` to the finished ones once each of its samples has a result or
        failed (failed and empty responses left out: an empty group is resampled upstream)."""
        group = self._groups[key]
        if len(group["results"]) + group["failed"] < self.attrs["n_samples"]:
            return
        del self._groups[key]
        results = sorted(group["results"], key=lambda r: r.meta["sample"])
        kept = drop_empty(results, self.counts, self.monitor)
        self._finished.append((*key, Rollouts([_trajectory(r, key, group["problem"], self.judge) for r in kept])))

    def has_work(self) -> bool:
        return bool(self._queue or self._finished) or self.engine.has_work()

    def occupancy(self) -> dict:
        """``{"rows": sequences the last engine step decoded, "slots": the engine's batch capacity}``."""
        return {"rows": self._last_rows, "slots": self.engine.max_batch_size}

    def step(self) -> list[tuple[int, int, Rollouts]]:
        """One engine step (first admitting queued requests into free slots when not
        interruptible); returns the groups finished since the last call: ``(index, attempt,
        rollouts)`` (the node's ``rollouts`` value), those finished while draining for a non-interruptible update and
        those whose every request failed included."""
        while self._queue and self.engine.num_active() < self.engine.max_batch_size:
            self._submit(self._queue.popleft())
        results = self.engine.step() if self.engine.has_work() else []
        self._last_rows = self.engine.num_active() + len(results)
        self._record(results)
        done, self._finished = self._finished, []
        return done

    def update_weights(self, state_dict, version: int) -> None:
        """Load ``version``: pause, load, resume (interruptible, the engines' own update),
        or first finish every sequence holding a slot with the old weights (module doc)."""
        if not self.interruptible:
            while self.engine.has_work():  # only slotted sequences: queued requests stay in self._queue
                self._record(self.engine.step())
        self.engine.update_weights(state_dict, version)

    def report(self) -> dict:
        """Its counters (``empty_responses``, ``generation_errors``, the prompt budget's) for the
        replica's report."""
        return {**self.counts, **self.budget.report()}

    def close(self) -> None:
        """Close the engine (frees its cache; a vLLM engine shuts down)."""
        self.engine.close()


class PromptBudget:
    """Prompts longer than the plan's prompt budget (module doc), counted; the first said on stderr.

    Args:
        node: the plan's generate node (named by its ``where()``). budget: tokens
            (``plan.workload["prompt_len"]``, from ``compile.max_prompt_len``); None (a plan without a
            workload) checks nothing.
    """

    def __init__(self, node, budget: int | None) -> None:
        self.node, self.budget = node, budget
        self.over, self.longest = 0, 0

    def check(self, n_tokens: int) -> None:
        """Count a prompt of ``n_tokens`` tokens."""
        self.longest = max(self.longest, n_tokens)
        if self.budget is None or n_tokens <= self.budget:
            return
        if not self.over:
            print(f"{self.node.where()}: a prompt of {n_tokens} tokens is longer than the {self.budget} tokens the plan "
                  "was sized for (compile.max_prompt_len): it runs, but the plan's memory and time figures "
                  "assume the budget; set compile.max_prompt_len to the longest prompt", file=sys.stderr)
        self.over += 1

    def report(self) -> dict:
        """``{"prompts_over_budget", "longest_prompt"}`` (tokens), or ``{}`` without a budget."""
        return {} if self.budget is None else {"prompts_over_budget": self.over, "longest_prompt": self.longest}


def drop_empty(results: list[GenerationResult], counts: dict, monitor: FailureMonitor) -> list[GenerationResult]:
    """``results`` without the responses that hold no token (module doc), each counted in
    ``counts["empty_responses"]`` and recorded on ``monitor`` (logged once; raises
    ``FailureFractionError`` past its fraction)."""
    kept = []
    for r in results:
        empty = not r.output_ids
        counts["empty_responses"] += empty
        detail = f"the engine returned no token (finish_reason {r.finish_reason!r})\n" if empty else ""
        monitor.record(Outcome(kind=EMPTY if empty else "", detail=detail), r.request_id)
        if not empty:
            kept.append(r)
    return kept


def sampling_params(node) -> SamplingParams:
    """The engine's per-request settings from a generator node's attributes."""
    a = node.attrs
    return SamplingParams(temperature=a["temperature"], top_p=a["top_p"], max_new_tokens=a["max_new_tokens"])


def build_engine(node, ctx):
    """The generation engine of a generator node (``generate`` or ``rollout``) on this replica.

    Slots: the plan's ``concurrent`` sequences per replica, capped by ``max_batch_size``;
    the seed differs per replica (replicas must not draw the same samples).

    Raises:
        EngineRefused: ``engine="vllm"`` with ``top_p < 1`` (class doc).
    """
    a = node.attrs
    if a.get("engine", "embedded") == "vllm" and a["top_p"] < 1:
        raise EngineRefused(f"{node.where()}: engine='vllm' with top_p={a['top_p']} reports truncated "
                            "log-probs (the importance ratio would be the kept mass); use top_p=1 or the "
                            "embedded engine")
    seed = ctx.seed + 1000 * ctx.rank
    folder = ctx.folders[node.model]
    slots = min(a["max_batch_size"], node.concurrent or a["max_batch_size"])
    if a.get("engine", "embedded") == "vllm":
        from runtime.engines.vllm_engine import VLLMEngine

        return VLLMEngine(folder, ctx.tokenizer, max_batch_size=slots, seed=seed,
                          dtype=str(ctx.dtype).removeprefix("torch."), threads=ctx.threads,
                          eager=not a.get("vllm_compile", False))
    from runtime.engines.generation import GenerationEngine
    from runtime.model_source import load_pretrained

    device = "cuda" if ctx.plan.device_type == "cuda" else "cpu"
    model, _ = load_pretrained(folder, dtype=ctx.dtype, in_memory=device == "cpu")
    return GenerationEngine(model, ctx.tokenizer, max_batch_size=slots, device=device, seed=seed,
                            dtype=a.get("engine_dtype", "float32"), head_dtype=a.get("engine_lm_head_dtype", "auto"),
                            cpu_kernels=a.get("engine_cpu_kernels", "auto"))


def answer_judge(plan) -> Callable[[str, str], bool] | None:
    """``correct(output_text, answer) -> bool`` of the task of ``plan``'s dataset node, or None
    when the plan has none or its task cannot judge a single response (an env task)."""
    source = next((n for n in plan.nodes if n.grain == "source"), None) if plan is not None else None
    return None if source is None else getattr(build_task(source.attrs, 0), "correct", None)


def _trajectory(result: GenerationResult, key: tuple[int, int], problem: Prompt,
                judge: Callable[[str, str], bool] | None = None) -> Trajectory:
    index, attempt = key
    return Trajectory(
        sample_id=f"{index}:{result.meta['sample']}", group_id=index, prompt_ids=list(result.prompt_ids),
        output_ids=list(result.output_ids), behavior_logprobs=list(result.behavior_logprobs),
        versions=list(result.versions), finish_reason=result.finish_reason, prompt_text=problem["prompt"],
        output_text=result.output_text, meta={"answer": problem["answer"], "problem_id": problem["id"], "attempt": attempt},
        correct=None if judge is None else bool(judge(result.output_text, problem["answer"])),
    )
