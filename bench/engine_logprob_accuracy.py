"""Behavior log-probs of the embedded engine against the trainer's fp32 recomputation.

For each engine dtype, the engine samples responses to the same chat prompts (SmolLM2 by
default); the trainer's function ``areal_flow.models.logprobs.token_logprobs`` then
recomputes every response token's log-prob with the fp32 model (the reference), and the
script prints the mean and max of ``|behavior - recomputed|`` over all response tokens
and the max of ``|exp(behavior - recomputed) - 1|``, the deviation it causes in the
importance ratio ``pi_prox / pi_behav`` (Schulman et al. 2017, eq. 6; decoupled form:
Hilton et al. 2022, eq. 4) when proximal and behavior policy have the same weights.

Run: ``.venv/bin/python bench/engine_logprob_accuracy.py [--model smollm2-135m] [--batch 32]``.
This is a measurement, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_flow.models.hf import load_model  # noqa: E402
from areal_flow.models.logprobs import token_logprobs  # noqa: E402
from areal_flow.ops.generate import encode_prompt  # noqa: E402
from areal_flow.tasks.arithmetic import ArithmeticTask  # noqa: E402
from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=32, help="prompts (one response each)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    task = ArithmeticTask(seed=0, max_digits=2, prompt_style="chat")
    prompts = [encode_prompt(tok, p["prompt"]) for p in task.test_set(args.batch)]
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    print(f"model {args.model}: {args.batch} responses of <= {args.max_new_tokens} tokens, T={args.temperature}")
    for dtype in args.dtypes:
        engine = GenerationEngine(model, tok, max_batch_size=args.batch, dtype=dtype, seed=0)
        results = engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
        seqs = [r.prompt_ids + r.output_ids for r in results]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        with torch.inference_mode():
            ref = token_logprobs(model, ids, mask, temperature=args.temperature)
        diffs = torch.cat([torch.tensor(r.behavior_logprobs) - ref[b, len(r.prompt_ids):len(seqs[b])]
                           for b, r in enumerate(results)])
        print(f"engine {dtype:9s} {diffs.numel():5d} tokens: mean |diff| {diffs.abs().mean():.2e}  "
              f"max |diff| {diffs.abs().max():.2e}  max |ratio - 1| {(diffs.exp() - 1).abs().max():.2e}")


if __name__ == "__main__":
    main()
