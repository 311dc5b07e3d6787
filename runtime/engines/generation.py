"""Embedded torch generation engine: batched sampling with a KV cache, continuous
batching, per-token behavior log-probs and versions, and interruptible weight updates.

Owns requests, their rows in the batch, sampling and versions; the forward passes and the
KV cache are ``runtime.engines.decoder``'s, the draw is ``runtime.engines.sampling``'s and
the dtype choice ``runtime.engines.precision``'s.

Every call to ``step`` gives each active sequence exactly one new token: sequences whose
cache is valid decode their last token; new sequences, and every sequence after a weight
update, are (re)prefilled from prompt + tokens generated so far and sample their next
token from the prefill logits. So a weight update discards nothing: the cache is
recomputed with the new weights and the following tokens carry the new version. A
sequence that finishes frees its row at once; the next ``step`` fills it from the queue.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from areal_flow.config import LM_HEAD_WORDS
from areal_flow.dtypes import torch_dtype
from runtime.engines.decoder import KVDecoder
from runtime.engines.precision import auto_speedup, engine_dtype
from runtime.engines.prefill_plan import Copy, plan_prefill, prefix_rows
from runtime.engines.sampling import sample
from runtime.weight_set import TensorSetError, check_tensor_set, tensor_set


class RequestRefused(ValueError):
    """An engine's ``submit`` refuses one request (named): empty prompt, prompt as long as
    the context, invalid sampling settings. The engine is unharmed; the caller fails that
    sample only (``runtime.executors.bugs``)."""


@dataclass
class SamplingParams:
    """Per-request sampling settings.

    Attributes:
        temperature: logits are divided by it; ``0`` means greedy (argmax).
        top_p: nucleus sampling mass in ``(0, 1]``; ignored when greedy.
        max_new_tokens: generation stops with ``"length"`` after this many tokens.
        stop_at_eos: stop with ``"stop"`` once an EOS id is sampled (kept in the output;
            every id of ``stop_token_ids``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop_at_eos: bool = True


@dataclass
class GenerationRequest:
    """One prompt to complete. ``request_id`` must be unique among in-flight requests;
    ``meta`` is opaque and returned untouched in the result."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    meta: dict = field(default_factory=dict)


@dataclass
class GenerationResult:
    """A finished request.

    Attributes:
        output_ids: generated ids, ``[response_len]``, EOS included when it stopped.
        behavior_logprobs: ``[response_len]`` natural-log probability of each sampled
            token under ``log_softmax(logits / temperature)`` of the weights that produced
            it: exactly ``token_logprobs(model, ..., temperature=T)``. With ``top_p < 1``
            the token was drawn from the nucleus-truncated, renormalised distribution, but
            the reported value is still the *untruncated* temperature-scaled log-prob (the
            one the trainer recomputes); the truncated one would add ``-log(kept mass)``.
            When greedy (``temperature == 0``) it is the log-prob at temperature 1.
        versions: ``[response_len]`` policy version that produced each token.
        finish_reason: ``"stop"`` (EOS) or ``"length"`` (``max_new_tokens`` or the
            model's context length reached).
        output_text: ``output_ids`` decoded without special tokens.
    """

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    behavior_logprobs: list[float]
    versions: list[int]
    finish_reason: str
    output_text: str
    meta: dict


def stop_token_ids(tokenizer, generation_eos: int | list[int] | None = None) -> frozenset[int]:
    """The token ids that end a sequence: the tokenizer's ``eos_token_id`` and every id of the
    model's ``generation_config.eos_token_id`` (an int or a list: chat models often list their
    end-of-turn token beside EOS, e.g. ``[151645, 151643]``)."""
    ids = [] if generation_eos is None else [generation_eos] if isinstance(generation_eos, int) else generation_eos
    return frozenset(int(i) for i in [tokenizer.eos_token_id, *ids] if i is not None)


def generation_config_eos(folder: str | Path) -> int | list[int] | None:
    """``eos_token_id`` of ``folder/generation_config.json`` (None without the file or key)."""
    path = Path(folder) / "generation_config.json"
    return json.loads(path.read_text()).get("eos_token_id") if path.exists() else None


def run_to_completion(engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    """Submit ``requests`` to an idle engine and step it until all finish; results in request order.

    Works for any engine with ``submit``, ``step`` and ``has_work`` (the embedded and vLLM engines).

    Raises:
        RuntimeError: the engine already has work in flight (use ``submit``/``step``).
    """
    if engine.has_work():
        raise RuntimeError(f"{type(engine).__name__}.generate needs an idle engine; use submit()/step()")
    for req in requests:
        engine.submit(req)
    done: dict[str, GenerationResult] = {}
    while engine.has_work():
        done.update((r.request_id, r) for r in engine.step())
    return [done[r.request_id] for r in requests]


class _Sequence:
    """Mutable state of one in-flight request."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        # (sequence, n): its row holds this row's first n positions bit for bit (prefill_plan.prefix_rows)
        self.prefix: tuple[_Sequence, int] | None = None

    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids


class GenerationEngine:
    """Continuous-batching sampler around a ``transformers`` causal LM (embedded, in-process).

    Args:
        model: Qwen2 / Llama / Qwen3-style ``PreTrainedModel``; moved to ``device`` and
            put in eval mode. The engine owns it from now on (``update_weights`` writes it)
            and decodes with a packed copy of its weights in the engine dtype.
        tokenizer: provides ``eos_token_id`` and decodes ``output_text``. Every id of
            :func:`stop_token_ids` (with the model's ``generation_config``) stops a sequence.
        max_batch_size: most sequences decoded at once; more requests wait in FIFO order.
        device: torch device string.
        seed: seeds the sampling generator (same seed + same request order = same samples).
        dtype: engine dtype of weights and KV cache (``gen.dtype``): ``"float32"``
            (default), ``"bfloat16"``, ``"float16"``, or ``"auto"`` (measured choice, see
            ``runtime.engines.precision``). Logits and sampling are always fp32. Behavior
            log-probs against the trainer's fp32 recomputation (``token_logprobs``, the
            reference), measured on SmolLM2-135M, 32 chat-arithmetic responses (~1,000
            tokens), T=1, by ``bench/engine_logprob_accuracy.py``: fp32 engine mean |diff|
            6.0e-6, max 3.8e-5 nats; bf16 engine mean 3.4e-2, max 0.31 and 0.81 in earlier
            runs and 0.81 again with the oneDNN-packed products (one token's importance ratio
            off by up to 125%). So bf16 suits the decoupled loss, whose PPO reference is the
            recomputation.
        head_dtype: dtype of the final norm and the LM head (``gen.lm_head_dtype``):
            ``"float32"`` (default: the last residual is cast up, so the logits take no bf16
            rounding of their own), ``"engine"`` (``dtype``'s) or a dtype name. Measured
            (``bench/engine_logprob_accuracy.py``, docs/PERFORMANCE.md "bf16 engine"): it
            removes about a third of the bf16 engine's mean error; the rest comes from the
            bf16 weights and the bf16 residual stream and KV cache. ``"mixed"``: the final norm in
            fp32, then the product (AMX or AVX-512 BF16) with bf16 inputs and weights and fp32 sums and logits
            (``runtime.engines.decoder.KVDecoder``'s ``mixed_head``; float32 where it cannot run).
            ``"auto"`` (default): ``"mixed"`` for a bf16 engine where it runs, else ``"float32"``.
        cpu_kernels: ``gen.cpu_kernels``, ``"auto"`` / ``"on"`` / ``"off"``
            (``runtime.engines.decoder.KVDecoder``).

    Thread safety: ``submit``, ``step`` and ``update_weights`` take one lock, so a weight
    update issued from another thread waits for the current step and lands between steps.

    Raises:
        ValueError: unsupported architecture, ``max_batch_size < 1``, an unknown ``dtype`` or
            ``head_dtype`` (names ``gen.dtype`` / ``gen.lm_head_dtype``), or
            ``cpu_kernels="on"`` where the fused kernels cannot run (names ``gen.cpu_kernels``).
    """

    def __init__(self, model, tokenizer, *, max_batch_size: int, device: str = "cpu", seed: int = 0,
                 dtype: str | torch.dtype = "float32", head_dtype: str | torch.dtype = "auto",
                 cpu_kernels: str = "auto") -> None:
        if max_batch_size < 1:
            raise ValueError(f"GenerationEngine: max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.eos_ids = stop_token_ids(tokenizer, getattr(getattr(model, "generation_config", None), "eos_token_id",
                                                         None))
        self.max_batch_size = max_batch_size
        self.device = device
        self.version = 0
        self.refused_updates = 0  # weight updates refused before touching the model (tensor set)
        self.dtype = engine_dtype(dtype, device, max_batch_size, self.model, cpu_kernels)
        # gen.dtype=auto: the measured fp32 / 16-bit decode-step time ratio behind the choice
        self.dtype_speedup = (auto_speedup(device, max_batch_size, self.model, cpu_kernels)
                              if str(dtype).lower() == "auto" else None)
        word = str(head_dtype).lower()
        self.head_dtype = self.dtype if word == "engine" else torch.float32 if word in ("mixed", "auto") else \
            torch_dtype(head_dtype, "gen.lm_head_dtype", extra=LM_HEAD_WORDS)
        # auto: the mixed head for a bf16 engine where it runs, quietly; an fp32 engine keeps its fp32 head
        mixed = True if word == "mixed" else None if word == "auto" and self.dtype == torch.bfloat16 else False
        self._dec = KVDecoder(self.model, self.dtype, max_batch_size, self.head_dtype, cpu_kernels,
                              mixed_head=mixed)
        self._gen = torch.Generator(device=device).manual_seed(seed)
        self._lock = threading.RLock()
        self._waiting: deque[_Sequence] = deque()
        self._cached: list[_Sequence] = []  # rows 0 .. len - 1 of the KV cache, in row order
        self._stale: list[_Sequence] = []  # active, cache to be (re)built by prefill
        self._ids: set[str] = set()
    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; it is admitted by a later ``step`` when a batch slot is free.

        Raises:
            RequestRefused: empty prompt, prompt as long as the model's context, or invalid
                sampling params (names the request): that request only.
            ValueError: ``request_id`` already in flight (the caller's bug).
        """
        p, rid = request.params, request.request_id
        if not request.prompt_ids:
            raise RequestRefused(f"request {rid!r}: empty prompt_ids")
        if len(request.prompt_ids) >= self._dec.max_len:
            raise RequestRefused(f"request {rid!r}: prompt of {len(request.prompt_ids)} tokens "
                                 f"leaves no room in the context of {self._dec.max_len}")
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.max_new_tokens < 1:
            raise RequestRefused(f"request {rid!r}: need temperature >= 0, 0 < top_p <= 1, "
                                 f"max_new_tokens >= 1; got {p}")
        with self._lock:
            if rid in self._ids:
                raise ValueError(f"request id {rid!r} is already in flight")
            self._ids.add(rid)
            self._waiting.append(_Sequence(request))

    def has_work(self) -> bool:
        """True while any request is waiting or being decoded."""
        with self._lock:
            return bool(self._waiting or self._cached or self._stale)

    def num_active(self) -> int:
        """Sequences currently holding a batch slot (<= ``max_batch_size``)."""
        with self._lock:
            return len(self._cached) + len(self._stale)

    @torch.inference_mode()
    def step(self) -> list[GenerationResult]:
        """Admit waiting requests into free slots, then add one token to every active
        sequence. Returns the requests that finished during this step (each exactly once)."""
        with self._lock:
            while self._waiting and self.num_active() < self.max_batch_size:
                self._stale.append(self._waiting.popleft())
            rows = self._cached + self._stale
            if not rows:
                return []
            # room for every active sequence's full response: the cache never grows mid-response
            self._dec.reserve(len(rows), min(self._dec.max_len, max(len(s.request.prompt_ids) + s.request.params.max_new_tokens
                                                                    for s in rows)))
            logits = []
            if self._cached:
                lengths = torch.tensor([len(s.tokens()) - 1 for s in self._cached], device=self.device)
                last = torch.tensor([s.output_ids[-1] for s in self._cached], device=self.device)
                shared = prefix_rows(self._cached) if self._dec.kernels is not None else None
                logits.append(self._dec.decode(last, lengths, shared))
            if self._stale:
                logits.append(self._prefill_stale(len(self._cached)))
            self._cached, self._stale = rows, []
            params = [s.request.params for s in rows]
            temps = torch.tensor([p.temperature for p in params], device=self.device)
            top_p = torch.tensor([p.top_p for p in params], device=self.device)
            # one source (decode or prefill) in most steps: skip the copy of [rows, vocab] fp32
            ids, logps = sample(logits[0] if len(logits) == 1 else torch.cat(logits), temps, top_p, self._gen,
                                self._dec.kernels)
            return self._record(rows, ids.tolist(), logps.tolist())

    def _prefill_stale(self, first_row: int) -> torch.Tensor:
        """Build the cache rows ``first_row ..`` of the stale sequences (new ones, and every one
        after a weight update) and return their next-token logits ``[len(stale), vocab]``.

        Rows that begin alike compute their common prefix once and copy it
        (``runtime.engines.prefill_plan``): a GRPO group's prompt is prefilled once, as vLLM's
        prefix caching gives (2.7 s against 0.34 s for SmolLM2's 32 rows of 48 tokens in fp32
        on one core); a prompt copies the longest beginning a cached row holds (another sample
        of its group, another prompt's system turn); distinct prompts admitted in the same step
        compute a common beginning once, where that skips enough tokens."""
        stale = self._stale
        # what each cached row holds, valid under the current weights (this step's decode has fed the last
        # token too; one token short is enough)
        cached = [seq.tokens()[:-1] for seq in self._cached]
        tokens = [seq.tokens() for seq in stale]
        holder = self._cached + stale  # cache row -> its sequence
        for seq in stale:
            seq.prefix = None
        logits = None
        for step in plan_prefill(tokens, [len(seq.request.prompt_ids) for seq in stale], cached, first_row):
            if isinstance(step, Copy):
                self._dec.copy_rows(step.src, step.dst, step.length)
                for src, dst, n in zip(step.src, step.dst, step.lengths):
                    holder[dst].prefix = (holder[src], n)
                continue
            part = self._dec.prefill([tokens[r][a:b] for r, a, b in zip(step.rows, step.starts, step.ends)],
                                     [first_row + r for r in step.rows], step.starts if any(step.starts) else None)
            if logits is None:
                logits = part.new_empty(len(stale), part.shape[1])
            src = torch.tensor([i for i, rows in enumerate(step.targets) for _ in rows], device=part.device)
            logits[[r for rows in step.targets for r in rows]] = part[src]
        return logits

    def _record(self, rows: list[_Sequence], ids: list[int], logps: list[float]) -> list[GenerationResult]:
        finished, done = [], set()
        for r, (seq, tok, lp) in enumerate(zip(rows, ids, logps)):
            seq.output_ids.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.version)
            p = seq.request.params
            if p.stop_at_eos and tok in self.eos_ids:
                finished.append(self._result(seq, "stop"))
            elif len(seq.output_ids) >= p.max_new_tokens or len(seq.tokens()) >= self._dec.max_len:
                finished.append(self._result(seq, "length"))
            else:
                continue
            done.add(r)
        if done:
            # keep the cache rows dense: live rows past the new end move into the freed ones
            n = len(rows) - len(done)
            holes = [r for r in sorted(done) if r < n]
            movers = [r for r in range(n, len(rows)) if r not in done]
            for src, dst in zip(movers, holes):
                self._dec.move_row(src, dst)
                rows[dst] = rows[src]
            self._cached = rows[:n]
        return finished

    def _result(self, seq: _Sequence, reason: str) -> GenerationResult:
        self._ids.discard(seq.request.request_id)
        seq.prefix = None  # a finished sequence no longer holds its source alive (nor a chain of them)
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        return GenerationResult(seq.request.request_id, list(seq.request.prompt_ids), seq.output_ids,
                                seq.logprobs, seq.versions, reason, text, seq.request.meta)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` to completion; results come back in request order.

        Raises:
            RuntimeError: the engine already has work in flight (use ``submit``/``step``).
        """
        return run_to_completion(self, requests)

    def reseed(self, seed: int) -> None:
        """Restart the sampling generator from ``seed`` (a replica does at each policy version
        it loads, so a resumed run samples what an uninterrupted one does: ``runtime.checkpoint``)."""
        with self._lock:
            self._gen.manual_seed(seed)

    def close(self) -> None:
        """Drop the KV cache and every request in flight (the engine stays usable, empty)."""
        with self._lock:
            self._dec.drop_cache()
            self._waiting.clear()
            self._cached, self._stale = [], []
            self._ids.clear()

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new policy weights mid-generation (interruptible generation).

        Waits for the running ``step`` to end, loads ``state_dict`` into the model, drops
        the KV cache and marks every in-flight sequence for re-prefill from prompt +
        tokens generated so far; the next ``step`` rebuilds the cache with the new
        weights, and every token sampled from then on carries ``version``.

        Atomic: the names and shapes are checked against the model's before any tensor is
        copied (``runtime.weight_set``; dtypes are cast on copy), so a refused update leaves
        the weights and :attr:`version` as they were (counted in ``refused_updates``).

        Raises:
            ValueError: ``version`` older than ``self.version``.
            TensorSetError: ``state_dict``'s names or shapes differ from the model's (names them).
        """
        with self._lock:
            if version < self.version:
                raise ValueError(f"update_weights: version {version} is older than the engine's {self.version}")
            try:
                check_tensor_set(tensor_set(self.model.state_dict()), state_dict,
                                 f"update_weights to version {version}", dtypes=False)
            except TensorSetError:
                self.refused_updates += 1
                raise
            with torch.no_grad():
                self.model.load_state_dict(state_dict, strict=True)
            self._dec.pack()
            self._dec.drop_cache()
            self._stale = self._cached + self._stale
            self._cached = []
            self.version = version
