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

Occupancy: :meth:`GenerateExecutor.occupancy` gives the rows the last engine step decoded
and the engine's slots; the replica writes both into each engine-step span of the trace
(``args.rows``, ``args.slots``).
"""

from __future__ import annotations

from collections import deque

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
        self.interruptible = bool(self.attrs.get("interruptible", True))
        self._queue: deque[GenerationRequest] = deque()  # not interruptible: requests not yet in the engine
        self._drained: list[GenerationResult] = []  # finished while draining for an update
        self._last_rows = 0
        self.counts = {"empty_responses": 0}
        self.monitor = FailureMonitor(f"generate node '{node.name}'", EMPTY_MAX_FRACTION, EMPTY_WINDOW)

    @property
    def version(self) -> int:
        return self.engine.version

    def submit(self, index: int, attempt: int, problem: dict) -> None:
        """Start the ``n_samples`` responses of prompt group ``index`` (its ``attempt``-th prompt)."""
        ids = encode_prompt(self.tokenizer, problem["prompt"], self.attrs.get("chat_template"))
        tag = "" if attempt == 1 else f"/{attempt}"
        self._groups[(index, attempt)] = {"problem": problem, "results": []}
        for j in range(self.attrs["n_samples"]):
            request = GenerationRequest(f"{index}:{j}{tag}", ids, self.params,
                                        {"group": index, "attempt": attempt, "sample": j})
            if self.interruptible:
                self.engine.submit(request)
            else:
                self._queue.append(request)

    def has_work(self) -> bool:
        return bool(self._queue or self._drained) or self.engine.has_work()

    def occupancy(self) -> dict:
        """``{"rows": sequences the last engine step decoded, "slots": the engine's batch capacity}``."""
        return {"rows": self._last_rows, "slots": self.engine.max_batch_size}

    def _engine_step(self) -> list[GenerationResult]:
        """One engine step (first admitting queued requests into free slots when not
        interruptible); records the rows it decoded."""
        while self._queue and self.engine.num_active() < self.engine.max_batch_size:
            self.engine.submit(self._queue.popleft())
        results = self.engine.step()
        self._last_rows = self.engine.num_active() + len(results)
        return results

    def step(self) -> list[tuple[int, int, list[Trajectory]]]:
        """One engine step; returns the groups it finished: ``(index, attempt, trajectories)``
        (with those finished while draining for a non-interruptible update)."""
        done = []
        results, self._drained = self._drained + self._engine_step(), []
        for result in results:
            key = (result.meta["group"], result.meta["attempt"])
            group = self._groups[key]
            group["results"].append(result)
            if len(group["results"]) == self.attrs["n_samples"]:
                del self._groups[key]
                results = sorted(group["results"], key=lambda r: r.meta["sample"])
                kept = drop_empty(results, self.counts, self.monitor)
                done.append((*key, [_trajectory(r, key, group["problem"]) for r in kept]))
        return done

    def update_weights(self, state_dict, version: int) -> None:
        """Load ``version``: pause, load, resume (interruptible, the engines' own update),
        or first finish every sequence holding a slot with the old weights (module doc)."""
        if not self.interruptible:
            while self.engine.has_work():  # only slotted sequences: queued requests stay in self._queue
                self._drained.extend(self.engine.step())
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
    return GenerationEngine(model, ctx.tokenizer, max_batch_size=slots, device=device, seed=seed,
                            dtype=a.get("engine_dtype", "float32"))


def _trajectory(result: GenerationResult, key: tuple[int, int], problem: dict) -> Trajectory:
    index, attempt = key
    return Trajectory(
        sample_id=f"{index}:{result.meta['sample']}", group_id=index, prompt_ids=list(result.prompt_ids),
        output_ids=list(result.output_ids), behavior_logprobs=list(result.behavior_logprobs),
        versions=list(result.versions), finish_reason=result.finish_reason, prompt_text=problem["prompt"],
        output_text=result.output_text, meta={"answer": problem["answer"], "problem_id": problem["id"], "attempt": attempt},
    )
