"""The embedded engine's decoder: packed weights in the engine's dtype, a preallocated
KV cache with one row per active sequence, and the prefill / decode forward passes.

Owns the numerics of generation (weights, cache, attention); the engine
(``runtime.engines.generation``) owns requests, sampling and versions.

Weights: read from the modules of a ``transformers`` Qwen2 / Llama / Qwen3-style causal LM
(embedding, RoPE, grouped-query attention, RMSNorm, SiLU-gated MLP) and packed per layer
into one QKV matrix ``[(heads + 2 kv_heads) * head_dim, hidden]`` and one gate+up matrix
``[2 * intermediate, hidden]``, cast to the engine dtype: 4 matrix products a layer instead
of 7. ``pack`` re-reads them after a weight update. A Mixture-of-Experts layer (Qwen3-MoE) keeps
its model's sparse block (router and experts, ``transformers``' forward) for the MLP.

Cache: per layer one key and one value tensor ``[rows, kv_heads, capacity, head_dim]``,
allocated once and grown by doubling (rows up to ``max_rows``, capacity up to the model's
context). Row ``r`` holds its sequence's keys at cache indices ``0 .. len_r - 1`` with no
padding in between, so a token's position equals its cache index and the attention mask
of row ``r`` is ``index < len_r`` (a prefill from an empty row needs causality only, one after a cached
prefix a mask over it: see ``prefill``; ``copy_rows`` gives a row another's prefix). A decode step writes
each row's new key in place (the attention kernel's ``new_keys``, or ``index_copy_`` on a flat view; no
``torch.cat``); a finished sequence's row is filled by moving the last active row into it.

Matrix products: ``runtime.engines.products`` (oneDNN's packed weights, or the CPU kernels' mixed
product for a bf16 engine on AVX-512 BF16), each weight packed once at ``pack`` time.

Numerics as in ``transformers``: RMSNorm computed in fp32 (Zhang & Sennrich 2019, eq. 4), rotary
embeddings from the model's own ``rotary_emb`` (Su et al. 2021, eq. 34), attention with the module's
``scaling`` by the fused kernel of ``runtime.engines.cpu_kernels`` on CPU (fp32 scores, softmax and sums; a
prefill's every position a decode-shaped problem over its row's cache) or ``F.scaled_dot_product_attention``
(``gen.cpu_kernels=off``, other devices); the
elementwise parts by ``runtime.engines.layer_ops`` (PyTorch's ops, or its ``FusedOps``); the residual stream is
kept in the engine dtype, the final norm and the LM head run in ``head_dtype`` (the last residual
cast to it; ``gen.lm_head_dtype``), logits are returned in fp32.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from areal_flow.config import CPU_KERNELS
from runtime.engines import cpu_kernels, layer_ops
from runtime.engines.products import kernel_products, linear, pack_weight

log = logging.getLogger(__name__)


def _cpu_kernels(mode: str, device: torch.device, dtype: torch.dtype):
    """The fused CPU kernels (``torch.ops.areal_flow``) for ``gen.cpu_kernels=mode``, or None for
    PyTorch's ops.

    Raises:
        ValueError: ``mode="on"`` where the kernels cannot run (not CPU, not fp32 / bf16, or their
            build failed: the message names ``gen.cpu_kernels`` and the cause), or an unknown mode.
    """
    if mode not in CPU_KERNELS:
        raise ValueError(f"gen.cpu_kernels={mode!r}: expected one of {', '.join(CPU_KERNELS)}")
    if mode == "off":
        return None
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        if mode == "on":
            raise ValueError(f"gen.cpu_kernels=on: the fused kernels run on CPU in float32 or bfloat16; this engine "
                             f"is {device.type}, {dtype}")
        return None
    try:
        return cpu_kernels.load()
    except RuntimeError as e:
        if mode == "on":
            raise ValueError(f"gen.cpu_kernels=on: {e}") from e
        log.warning("gen.cpu_kernels=auto: the fused CPU kernels are unavailable, using PyTorch's ops (%s)", e)
        return None


class _Layer:
    """One decoder layer's packed weights (engine dtype; matrices by ``pack``: :func:`pack_weight`)."""

    def __init__(self, layer, dtype: torch.dtype, pack_matrix) -> None:
        attn, mlp = layer.self_attn, layer.mlp

        def cast(t):
            return None if t is None else t.detach().to(dtype)

        def pack(t):
            return pack_matrix(cast(t))

        def bias(lin):
            return lin.bias if lin.bias is not None else torch.zeros(lin.out_features, device=lin.weight.device)

        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.wqkv = pack(torch.cat([p.weight for p in projs]))
        self.bqkv = cast(torch.cat([bias(p) for p in projs])) if any(p.bias is not None for p in projs) else None
        self.wo, self.bo = pack(attn.o_proj.weight), cast(attn.o_proj.bias)
        self.moe = mlp if hasattr(mlp, "experts") else None  # routed experts: the model's own block runs them
        if self.moe is None:
            self.wgu = pack(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            gu_bias = mlp.gate_proj.bias is not None
            self.bgu = cast(torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])) if gu_bias else None
            self.wd, self.bd = pack(mlp.down_proj.weight), cast(mlp.down_proj.bias)
        self.ln1, self.ln2 = cast(layer.input_layernorm.weight), cast(layer.post_attention_layernorm.weight)
        self.eps1 = layer.input_layernorm.variance_epsilon
        self.eps2 = layer.post_attention_layernorm.variance_epsilon
        self.qn = cast(attn.q_norm.weight) if hasattr(attn, "q_norm") else None
        self.kn = cast(attn.k_norm.weight) if hasattr(attn, "k_norm") else None
        self.qk_eps = attn.q_norm.variance_epsilon if hasattr(attn, "q_norm") else 0.0
        self.scaling = attn.scaling


class KVDecoder:
    """Forward passes of a HF decoder-only LM against the row-per-sequence KV cache.

    Args:
        model: Qwen2 / Llama / Qwen3-style causal LM (``model.model.{embed_tokens, layers,
            norm, rotary_emb}`` + ``lm_head``), SiLU MLP, no sliding window.
        dtype: engine dtype of the packed weights and the KV cache.
        max_rows: most sequences in the cache (the engine's ``max_batch_size``).
        head_dtype: dtype of the final norm and the LM head; None = ``dtype``.
        cpu_kernels: ``gen.cpu_kernels``: ``"auto"`` (the fused CPU kernels of ``runtime.engines.cpu_kernels``
            for an fp32 or bf16 engine where they can run, else PyTorch's ops), ``"on"`` (the kernels or
            ``ValueError``) or ``"off"``.
        mixed_head: True (``gen.lm_head_dtype=mixed``): the LM head by the mixed-precision kernel
            (``csrc/lm_head.cpp``: the fp32 final norm's output and the head weights rounded to
            bf16, fp32 sums and logits) where the CPU kernels are loaded and the CPU has AMX or
            AVX-512 BF16;
            elsewhere the ``head_dtype`` product, with a warning. None (``auto``): the same but
            quietly. False: the ``head_dtype`` product.

    Raises:
        ValueError: unsupported architecture (names the model class or config field), or
            ``cpu_kernels="on"`` where the kernels cannot run.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, max_rows: int,
                 head_dtype: torch.dtype | None = None, cpu_kernels: str = "auto",
                 mixed_head: bool | None = False) -> None:
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
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"GenerationEngine: hidden_act={cfg.hidden_act!r} is not supported (silu only)")
        self.model, self.base, self.dtype, self.max_rows = model, base, dtype, max_rows
        self.head_dtype = head_dtype or dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.max_len = cfg.max_position_embeddings
        self.vocab = model.lm_head.weight.shape[0]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.kernels = _cpu_kernels(cpu_kernels, model.lm_head.weight.device, dtype)
        self.ops = layer_ops if self.kernels is None else layer_ops.FusedOps(self.kernels)
        self.mixed_head = mixed_head is not False and self._mixed_head_runs(warn=mixed_head is True)
        self.kernel_products = kernel_products(self.kernels, dtype)  # the layers' matrices by the kernels' product
        self.pack()

    def _mixed_head_runs(self, warn: bool) -> bool:
        """Whether the mixed-precision LM head kernel (AMX or AVX-512 BF16) runs here (a one-row
        product tried once); ``warn``: say why not."""
        why = "gen.cpu_kernels did not load the CPU kernels"
        if self.kernels is not None:
            try:
                packed = self.kernels.pack_lm_head(torch.zeros(16, 32, dtype=torch.bfloat16))
                self.kernels.lm_head(torch.zeros(1, 32), packed, 16)
                return True
            except RuntimeError as e:
                why = str(e).splitlines()[0]
        if warn:
            log.warning("gen.lm_head_dtype=mixed: the mixed head cannot run here (%s); the LM head runs in float32", why)
        return False

    def pack(self) -> None:
        """(Re)build the packed weights from the model's current parameters, releasing each old
        pack (a layer's, the embedding's, the head's) before its new one is built: a reload
        holds one layer's weights twice at most, not the whole model, and the new pack reuses
        the memory the old one freed (SmolLM2 bf16, alone: resident 2.40 GB after the first
        reload against 2.60 GB building every layer first; 0.70 against 0.76 s)."""
        with torch.no_grad():
            layers = getattr(self, "layers", None) or [None] * len(self.base.layers)
            products = self.kernels if self.kernel_products else None

            def pack_matrix(weight):
                return pack_weight(weight, self.max_rows, products)

            for i, layer in enumerate(self.base.layers):
                layers[i] = None
                layers[i] = _Layer(layer, self.dtype, pack_matrix)
            self.layers = layers
            self.embed = self.head = None
            self.embed = self.base.embed_tokens.weight.detach().to(self.dtype)
            head = self.model.lm_head.weight
            same = head.data_ptr() == self.base.embed_tokens.weight.data_ptr() and self.head_dtype == self.dtype
            if self.mixed_head:
                self.head = self.kernels.pack_lm_head(head.detach().to(torch.bfloat16))
            else:
                self.head = pack_matrix(self.embed if same else head.detach().to(self.head_dtype))
            bias = self.model.lm_head.bias
            self.head_bias = None if bias is None else bias.detach().to(self.head_dtype)
            self.norm = self.base.norm.weight.detach().to(self.head_dtype)
            self.norm_eps = self.base.norm.variance_epsilon

    def reserve(self, rows: int, length: int) -> None:
        """Make the cache hold at least ``rows`` rows of ``length`` tokens (doubling growth,
        capped at ``max_rows`` and the model's context); existing contents are kept."""
        have_rows = self.keys[0].shape[0] if self.keys else 0
        have_len = self.keys[0].shape[2] if self.keys else 0
        if rows <= have_rows and length <= have_len:
            return
        new_rows = min(self.max_rows, max(rows, 2 * have_rows)) if rows > have_rows else have_rows
        new_len = min(self.max_len, max(length, 2 * have_len, 64)) if length > have_len else have_len
        device = self.embed.device
        shape = (new_rows, self.n_kv, new_len, self.head_dim)
        for cache in (self.keys, self.values):
            for i in range(len(self.layers)):
                grown = torch.zeros(shape, dtype=self.dtype, device=device)
                if i < len(cache):
                    grown[:have_rows, :, :have_len] = cache[i]
                    cache[i] = grown
                else:
                    cache.append(grown)

    def drop_cache(self) -> None:
        """Free the cache (after a weight update every sequence is prefilled again)."""
        self.keys, self.values = [], []

    def move_row(self, src: int, dst: int) -> None:
        """Copy cache row ``src`` into row ``dst`` (fills the row of a finished sequence)."""
        for cache in (self.keys, self.values):
            for c in cache:
                c[dst] = c[src]

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Run every layer on ``h [rows, T, hidden]``; ``attend(i, q, k, v, scale)`` returns
        ``[rows, heads, T, hd]``. Returns the final norm of the last layer's output, ``[rows, T, hidden]``."""
        cos, sin = self.base.rotary_emb(h, positions)
        half = self.head_dim // 2
        # rotate_half(x) * sin == flip_halves(x) * (sin with its first half negated)
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rows, t, _ = h.shape
        x = self.ops.rms_norm(h, self.layers[0].ln1, self.layers[0].eps1)
        for i, w in enumerate(self.layers):
            qkv = linear(x, w.wqkv, w.bqkv)
            q, k, v = self.ops.rope_split(qkv, cos, sin, self.n_heads, self.n_kv, w.qn, w.kn, w.qk_eps)
            o = attend(i, q, k, v, w.scaling)
            attn_out = linear(o.transpose(1, 2).reshape(rows, t, -1), w.wo, w.bo)
            h, x = self.ops.add_rms_norm(h, attn_out, w.ln2, w.eps2)
            if w.moe is None:
                mlp_out = linear(self.ops.silu_mul(linear(x, w.wgu, w.bgu)), w.wd, w.bd)
            else:  # in the block's own dtype (routing, top-k experts, weighted sum), back in the engine's
                mlp_out = w.moe(x.to(w.moe.gate.weight.dtype)).to(x.dtype)
            # the residual add meets the next layer's input norm, or the final norm after the last layer
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            if nxt is not None:
                h, x = self.ops.add_rms_norm(h, mlp_out, nxt.ln1, nxt.eps1)
            else:  # the final norm, in the LM head's dtype
                x = self.ops.rms_norm((h + mlp_out).to(self.head_dtype), self.norm, self.norm_eps)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """LM head on the final-normed ``x [rows, hidden]`` -> fp32 logits ``[rows, vocab]``."""
        if self.mixed_head:  # fp32 logits, the bias added to the fp32 sums
            return self.kernels.lm_head(x, self.head, self.vocab, self.head_bias)
        return linear(x, self.head, self.head_bias).float()

    def copy_rows(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first ``length`` cached positions of rows ``src[i]`` into rows ``dst[i]``
        (a group's shared prompt, prefilled once, given to every sample of the group)."""
        if not dst:
            return
        device = self.keys[0].device
        s, d = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        for cache in (self.keys, self.values):
            for c in cache:
                c[d, :, :length] = c[s, :, :length]

    def prefill(self, seqs: list[list[int]], rows: list[int], starts: list[int] | None = None) -> torch.Tensor:
        """Forward of ``seqs`` (right-padded together) into cache rows ``rows`` (``reserve``
        must have made room), each continuing the ``starts[r]`` positions already cached in
        its row (0: the whole sequence; > 0: the tokens after a prefix another row prefilled,
        :meth:`copy_rows`). Its keys/values land at positions ``starts[r] ..``.
        Returns last-token logits ``[len(seqs), vocab]`` fp32."""
        device = self.embed.device
        n, width = len(seqs), max(len(s) for s in seqs)
        ids = torch.zeros(n, width, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s)
        ids = ids.to(device)
        lengths = torch.tensor([len(s) for s in seqs], device=device)
        index = torch.tensor(rows, device=device)
        start = torch.tensor(starts or [0] * n, device=device)
        pos = start[:, None] + torch.arange(width, device=device)
        prefix = bool(starts and any(starts))
        real = torch.arange(width, device=device)[None, :] < lengths[:, None]
        if prefix:
            # each real token's flat index (row, kv head, position) in a [rows * kv * cap, hd] view of the cache
            cap = self.keys[0].shape[2]
            heads = index[:, None, None] * self.n_kv + torch.arange(self.n_kv, device=device)[None, None, :]
            flat = (heads * cap + pos[:, :, None])[real].reshape(-1)
        if self.kernels is not None:  # each (sequence, position) a decode-shaped problem over its row's cache
            query_lens = torch.where(real, pos, 0).reshape(-1)  # a padding query (never read) reads position 0 only
            query_rows = index.repeat_interleave(width)
        elif prefix:
            span = int((start + lengths).max())
            mask = (torch.arange(span, device=device)[None, None, :] <= pos[:, :, None])[:, None]

        def attend(i, q, k, v, scale):
            kc, vc = self.keys[i], self.values[i]
            if prefix:  # only real tokens are written (padding could run past the row's capacity)
                kc.view(-1, self.head_dim).index_copy_(0, flat, k.transpose(1, 2)[real].reshape(-1, self.head_dim))
                vc.view(-1, self.head_dim).index_copy_(0, flat, v.transpose(1, 2)[real].reshape(-1, self.head_dim))
            else:
                kc[index, :, :width] = k
                vc[index, :, :width] = v
            if self.kernels is not None:
                # q [n, heads, T, hd] -> [n * T, kv, g, hd] (query head j * g + i is (j, i), as in decode); the
                # query at position p of row r reads its cache row's keys 0 .. p, the prefix included
                grouped = q.unflatten(1, (self.n_kv, -1)).permute(0, 3, 1, 2, 4).reshape(n * width, self.n_kv, -1,
                                                                                          self.head_dim).contiguous()
                out = self.kernels.decode_attention(grouped, kc, vc, query_lens, scale, query_rows)
                return out.view(n, width, -1, self.head_dim).transpose(1, 2)
            if not prefix:
                # Causal alone is exact for the real tokens: with right padding, a query at position
                # p < len_r sees keys 0..p, all real. Padding queries see padding keys; their outputs
                # are never read and their cache entries lie at indices >= len_r, which decode
                # overwrites before its mask (index <= length) admits them.
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            # a query sees its row's cached prefix and its own chunk up to itself; padding queries are never read
            return F.scaled_dot_product_attention(q, kc[index, :, :span], vc[index, :, :span], attn_mask=mask,
                                                  scale=scale, enable_gqa=True)

        x = self._layers(F.embedding(ids, self.embed), pos, attend)
        return self._logits(x[torch.arange(n, device=device), lengths - 1])

    def decode(self, last_ids: torch.Tensor, lengths: torch.Tensor,
               prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Feed ``last_ids [A]`` (cache rows ``0 .. A-1``) at positions ``lengths [A]``,
        writing their keys/values in place (capacity must exceed ``lengths.max()``).
        ``prefix``: ``(rows [A], lens [A])`` int64 on CPU, row r's first ``lens[r]`` positions
        read from cache row ``rows[r]``, which holds the same bits (``decode_attention``'s
        ``prefix_rows``; used by the CPU kernels only, where it saves memory traffic).
        Returns logits ``[A, vocab]`` fp32."""
        a = last_ids.shape[0]
        cap = self.keys[0].shape[2]
        device = last_ids.device
        if self.kernels is None:
            span = int(lengths.max()) + 1
            mask = (torch.arange(span, device=device)[None, :] <= lengths[:, None])[:, None, None, :]
            # flat index of (row r, kv head j, position lengths[r]) in a [rows * kv * cap, hd] view
            heads = torch.arange(a, device=device)[:, None] * self.n_kv + torch.arange(self.n_kv, device=device)
            flat = (heads * cap + lengths[:, None]).reshape(-1)

        def attend(i, q, k, v, scale):
            kc, vc = self.keys[i], self.values[i]
            # GQA as grouped queries: the g query heads of kv head j (heads j*g .. j*g+g-1, the
            # order enable_gqa's repeat_interleave gives) are a length-g query of that head, so
            # no key/value is copied per query head (CPU: 5x faster at 64 rows, 9/3 heads).
            grouped = q.reshape(a, self.n_kv, -1, self.head_dim)
            if self.kernels is not None:  # writes the step's keys/values at lengths, then all rows x kv heads
                out = self.kernels.decode_attention(grouped.contiguous(), kc, vc, lengths, scale, None,
                                                    k.reshape(a, self.n_kv, self.head_dim),
                                                    v.reshape(a, self.n_kv, self.head_dim), *(prefix or (None, None)))
            else:
                kc.view(-1, self.head_dim).index_copy_(0, flat, k.reshape(-1, self.head_dim))
                vc.view(-1, self.head_dim).index_copy_(0, flat, v.reshape(-1, self.head_dim))
                out = F.scaled_dot_product_attention(grouped, kc[:a, :, :span], vc[:a, :, :span], attn_mask=mask,
                                                     scale=scale)
            return out.reshape(a, -1, 1, self.head_dim)

        x = self._layers(F.embedding(last_ids[:, None], self.embed), lengths[:, None], attend)
        return self._logits(x[:, 0])
