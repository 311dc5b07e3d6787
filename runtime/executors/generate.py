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

A request the engine refuses (``submit`` raises for that one request: a prompt as long as
the context, a tokenizer fault) fails that sample only, like a failed reward: the sample is
left out of its group (a group left empty is resampled), counted (``generation_errors``),
logged once per exception type with its traceback, and the worker lives on. Empty responses
and generation errors share one monitor: the run stops with one line when more than
``reward.max_failure_fraction`` (node attribute ``max_failure_fraction``) of the last
``reward.failure_window`` responses failed.
"""

from __future__ import annotations

import traceback

from areal_flow.ops.generate import encode_prompt
from areal_flow.rewards.pool import FailureMonitor, Outcome
from areal_flow.types import Trajectory
from runtime.engines.generation import GenerationRequest, GenerationResult, SamplingParams


EMPTY = "empty response"
EMPTY_MAX_FRACTION, EMPTY_WINDOW = 0.5, 200  # stop when more than half of the last 200 responses were empty


class EngineRefused(ValueError):
    """The node's settings ask for something its engine cannot do (named)."""


class GenerateExecutor:
    """Grain ``stream``: groups in, finished groups out, at the engine's pace.

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
        self._groups: dict[tuple[int, int], dict] = {}
        self._failed: list[tuple[int, int, list[Trajectory]]] = []  # groups every request of which failed
        self.counts = {"empty_responses": 0, "generation_errors": 0}
        self.monitor = FailureMonitor(f"generate node '{node.name}'", self.attrs.get("max_failure_fraction",
                                      EMPTY_MAX_FRACTION), self.attrs.get("failure_window", EMPTY_WINDOW))

    @property
    def version(self) -> int:
        return self.engine.version

    def submit(self, index: int, attempt: int, problem: dict) -> None:
        """Start the ``n_samples`` responses of prompt group ``index`` (its ``attempt``-th prompt)."""
        ids = encode_prompt(self.tokenizer, problem["prompt"], self.attrs.get("chat_template"))
        tag = "" if attempt == 1 else f"/{attempt}"
        group = self._groups[(index, attempt)] = {"problem": problem, "results": [], "failed": 0}
        for j in range(self.attrs["n_samples"]):
            request = GenerationRequest(f"{index}:{j}{tag}", ids, self.params,
                                        {"group": index, "attempt": attempt, "sample": j})
            try:
                self.engine.submit(request)
            except Exception as exc:  # this request's fault only: its sample fails (module doc)
                self.counts["generation_errors"] += 1
                group["failed"] += 1
                self.monitor.record(Outcome(kind=f"generation error ({type(exc).__name__})",
                                            detail=traceback.format_exc()), request.request_id)
        if group["failed"] == self.attrs["n_samples"]:  # nothing reached the engine: done already
            del self._groups[(index, attempt)]
            self._failed.append((index, attempt, []))

    def has_work(self) -> bool:
        return bool(self._failed) or self.engine.has_work()

    def step(self) -> list[tuple[int, int, list[Trajectory]]]:
        """One engine step; returns the groups it finished: ``(index, attempt, trajectories)``."""
        done, self._failed = self._failed, []
        for result in self.engine.step() if self.engine.has_work() else []:
            key = (result.meta["group"], result.meta["attempt"])
            group = self._groups[key]
            group["results"].append(result)
            if len(group["results"]) + group["failed"] == self.attrs["n_samples"]:
                del self._groups[key]
                results = sorted(group["results"], key=lambda r: r.meta["sample"])
                kept = drop_empty(results, self.counts, self.monitor)
                done.append((*key, [_trajectory(r, key, group["problem"]) for r in kept]))
        return done

    def update_weights(self, state_dict, version: int) -> None:
        """Pause, load ``version``, resume (the engines' interruptible update)."""
        self.engine.update_weights(state_dict, version)


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
                          dtype=ctx.plan.run.get("dtype", "float32"), threads=ctx.threads)
    from runtime.engines.generation import GenerationEngine
    from runtime.model_source import load_pretrained

    model, _ = load_pretrained(folder, dtype=ctx.dtype)
    device = "cuda" if ctx.plan.device_type == "cuda" else "cpu"
    return GenerationEngine(model, ctx.tokenizer, max_batch_size=slots, device=device, seed=seed)


def _trajectory(result: GenerationResult, key: tuple[int, int], problem: dict) -> Trajectory:
    index, attempt = key
    return Trajectory(
        sample_id=f"{index}:{result.meta['sample']}", group_id=index, prompt_ids=list(result.prompt_ids),
        output_ids=list(result.output_ids), behavior_logprobs=list(result.behavior_logprobs),
        versions=list(result.versions), finish_reason=result.finish_reason, prompt_text=problem["prompt"],
        output_text=result.output_text, meta={"answer": problem["answer"], "problem_id": problem["id"], "attempt": attempt},
    )
