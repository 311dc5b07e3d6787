"""Embedded torch generation engine: batched sampling with a KV cache, continuous
batching, per-token behavior log-probs and versions, and interruptible weight updates.

The decoder loop is hand-written over the modules of a ``transformers`` Qwen2 / Llama /
Qwen3-style causal LM (embedding, RoPE, grouped-query attention, RMSNorm, gated MLP), so
the cache layout is ours: one row per active sequence, ``[rows, kv_heads, capacity,
head_dim]`` per layer. Row ``r`` holds its sequence's keys at cache indices
``0 .. len_r - 1`` with no padding in between, so the position of a token equals its
cache index (``cumsum(mask) - 1`` of a left-padded batch) and the attention mask of row
``r`` is ``index < len_r`` (plus causality inside a prefill). Prompts of different
lengths are prefilled together right-padded; the padded keys sit beyond ``len_r``,
are masked out, and are overwritten by later tokens.

Every call to ``step`` gives each active sequence exactly one new token: sequences whose
cache is valid decode their last token; new sequences, and every sequence after a weight
update, are (re)prefilled from prompt + tokens generated so far and sample their next
token from the prefill logits. So a weight update discards nothing: the cache is
recomputed with the new weights and the following tokens carry the new version.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.weight_set import TensorSetError, check_tensor_set, tensor_set


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

    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _KVDecoder:
    """Forward passes of a HF decoder-only LM against our row-per-sequence KV cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        base = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is None or not all(hasattr(base, n) for n in needed) or not hasattr(model, "lm_head"):
            raise ValueError(
                f"GenerationEngine supports Qwen2/Llama/Qwen3-style causal LMs "
                f"(model.model.{{{', '.join(needed)}}} + lm_head); got {type(model).__name__}"
            )
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError(f"GenerationEngine: sliding-window attention is not supported ({cfg.model_type})")
        self.model, self.base = model, base
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.max_len = cfg.max_position_embeddings

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Run every layer on ``h [rows, T, hidden]``; ``attend(i, q, k, v)`` returns ``[rows, heads, T, hd]``."""
        cos, sin = self.base.rotary_emb(h, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rows, t, _ = h.shape
        for i, layer in enumerate(self.base.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(rows, t, self.n_heads, self.head_dim)
            k = attn.k_proj(x).view(rows, t, self.n_kv, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = attn.v_proj(x).view(rows, t, self.n_kv, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = attend(i, q, k, v, attn.scaling)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(rows, t, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.base.norm(h)).float()

    def prefill(self, seqs: list[list[int]], device: str):
        """Full forward of right-padded ``seqs``. Returns last-token logits ``[N, vocab]``
        and per-layer ``(keys, values)`` lists of ``[N, kv_heads, max_len, head_dim]``."""
        n, width = len(seqs), max(len(s) for s in seqs)
        ids = torch.zeros(n, width, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s)
        ids = ids.to(device)
        lengths = torch.tensor([len(s) for s in seqs], device=device)
        pos = torch.arange(width, device=device)
        # mask[r, 0, q, k]: causal and key is a real token of row r.
        mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lengths[:, None, None])
        mask = mask.unsqueeze(1)
        keys, values = [], []

        def attend(i, q, k, v, scale):
            keys.append(k)
            values.append(v)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

        h = self._layers(self.base.embed_tokens(ids), pos.expand(n, width), attend)
        last = h[torch.arange(n, device=device), lengths - 1]
        return self._logits(last), keys, values

    def decode(self, last_ids: torch.Tensor, lengths: torch.Tensor, keys, values) -> torch.Tensor:
        """Feed ``last_ids [A]`` at positions ``lengths [A]``, writing their keys/values
        into the cache in place (capacity must exceed ``lengths.max()``). Returns ``[A, vocab]``."""
        rows = torch.arange(last_ids.shape[0], device=last_ids.device)
        span = int(lengths.max()) + 1
        mask = (torch.arange(span, device=last_ids.device)[None, :] <= lengths[:, None])[:, None, None, :]

        def attend(i, q, k, v, scale):
            keys[i][rows, :, lengths] = k[:, :, 0]
            values[i][rows, :, lengths] = v[:, :, 0]
            kk, vv = keys[i][:, :, :span], values[i][:, :, :span]
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)

        h = self._layers(self.base.embed_tokens(last_ids[:, None]), lengths[:, None], attend)
        return self._logits(h[:, 0])


def _sample(logits: torch.Tensor, params: list[SamplingParams], gen: torch.Generator):
    """Draw one token per row of ``logits [R, vocab]`` (fp32). Returns ids ``[R]`` and
    behavior log-probs ``[R]`` as documented on ``GenerationResult``."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    greedy = temps == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    ids = logits.argmax(-1)
    if not bool(greedy.all()):
        probs = logp.exp()
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        if bool((top_p < 1).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p: drop a token when the
            # mass strictly before it already reaches top_p (the first is always kept).
            drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p[:, None]
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        drawn = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        ids = torch.where(greedy, ids, drawn)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


class GenerationEngine:
    """Continuous-batching sampler around a ``transformers`` causal LM (embedded, in-process).

    Args:
        model: Qwen2 / Llama / Qwen3-style ``PreTrainedModel``; moved to ``device`` and
            put in eval mode. The engine owns it from now on (``update_weights`` writes it).
        tokenizer: provides ``eos_token_id`` and decodes ``output_text``. Every id of
            :func:`stop_token_ids` (with the model's ``generation_config``) stops a sequence.
        max_batch_size: most sequences decoded at once; more requests wait in FIFO order.
        device: torch device string.
        seed: seeds the sampling generator (same seed + same request order = same samples).

    Thread safety: ``submit``, ``step`` and ``update_weights`` take one lock, so a weight
    update issued from another thread waits for the current step and lands between steps.

    Raises:
        ValueError: unsupported architecture or ``max_batch_size < 1``.
    """

    def __init__(self, model, tokenizer, *, max_batch_size: int, device: str = "cpu", seed: int = 0) -> None:
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
        self._dec = _KVDecoder(self.model)
        self._gen = torch.Generator(device=device).manual_seed(seed)
        self._lock = threading.RLock()
        self._waiting: deque[_Sequence] = deque()
        self._cached: list[_Sequence] = []  # rows of the KV cache, in row order
        self._stale: list[_Sequence] = []  # active, cache to be (re)built by prefill
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._ids: set[str] = set()

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; it is admitted by a later ``step`` when a batch slot is free.

        Raises:
            ValueError: duplicate in-flight ``request_id``, empty prompt, prompt as long as
                the model's context, or invalid sampling params (names the request).
        """
        p, rid = request.params, request.request_id
        if not request.prompt_ids:
            raise ValueError(f"request {rid!r}: empty prompt_ids")
        if len(request.prompt_ids) >= self._dec.max_len:
            raise ValueError(f"request {rid!r}: prompt of {len(request.prompt_ids)} tokens "
                             f"leaves no room in the context of {self._dec.max_len}")
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.max_new_tokens < 1:
            raise ValueError(f"request {rid!r}: need temperature >= 0, 0 < top_p <= 1, "
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
            if not (self._cached or self._stale):
                return []
            logits = []
            if self._cached:
                lengths = torch.tensor([len(s.tokens()) - 1 for s in self._cached], device=self.device)
                self._ensure_capacity(int(lengths.max()) + 1)
                last = torch.tensor([s.tokens()[-1] for s in self._cached], device=self.device)
                logits.append(self._dec.decode(last, lengths, self._keys, self._values))
            fresh = self._stale
            if fresh:
                pre_logits, k_new, v_new = self._dec.prefill([s.tokens() for s in fresh], self.device)
                logits.append(pre_logits)
                self._append_rows(k_new, v_new)
            rows = self._cached + fresh
            self._cached, self._stale = rows, []
            ids, logps = _sample(torch.cat(logits), [s.request.params for s in rows], self._gen)
            return self._record(rows, ids.tolist(), logps.tolist())

    def _record(self, rows: list[_Sequence], ids: list[int], logps: list[float]) -> list[GenerationResult]:
        finished, keep = [], []
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
                keep.append(r)
        if len(keep) < len(rows):
            self._cached = [rows[r] for r in keep]
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            self._keys = [k.index_select(0, index) for k in self._keys]
            self._values = [v.index_select(0, index) for v in self._values]
        return finished

    def _result(self, seq: _Sequence, reason: str) -> GenerationResult:
        self._ids.discard(seq.request.request_id)
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        return GenerationResult(seq.request.request_id, list(seq.request.prompt_ids), seq.output_ids,
                                seq.logprobs, seq.versions, reason, text, seq.request.meta)

    def _ensure_capacity(self, needed: int) -> None:
        have = self._keys[0].shape[2] if self._keys else 0
        if needed > have:
            grow = max(needed, 2 * have) - have
            self._keys = [F.pad(k, (0, 0, 0, grow)) for k in self._keys]
            self._values = [F.pad(v, (0, 0, 0, grow)) for v in self._values]

    def _append_rows(self, k_new: list[torch.Tensor], v_new: list[torch.Tensor]) -> None:
        """Concatenate freshly prefilled rows after the cached ones (padding time to match)."""
        if not self._cached:
            self._keys, self._values = list(k_new), list(v_new)
            return
        self._ensure_capacity(k_new[0].shape[2])
        cap = self._keys[0].shape[2]
        pad = (0, 0, 0, cap - k_new[0].shape[2])
        self._keys = [torch.cat([k, F.pad(kn, pad)]) for k, kn in zip(self._keys, k_new)]
        self._values = [torch.cat([v, F.pad(vn, pad)]) for v, vn in zip(self._values, v_new)]

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` to completion; results come back in request order.

        Raises:
            RuntimeError: the engine already has work in flight (use ``submit``/``step``).
        """
        return run_to_completion(self, requests)

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
            self._stale = self._cached + self._stale
            self._cached, self._keys, self._values = [], [], []
            self.version = version
