"""Behavior log-probs of the embedded engine against the trainer's recomputation, by engine
precision, and where the 16-bit error comes from.

For each engine variant the engine samples responses to the same prompts; the trainer's
function ``areal_flow.models.logprobs.token_logprobs`` then recomputes every response
token's log-prob (the proximal policy of the decoupled loss when the weights are the same)
in fp32 and under bf16 autocast (what the trainer computes with ``model.dtype=bfloat16``),
and the script prints, per reference, the mean and max of ``|behavior - recomputed|`` over
all response tokens and the max of ``|exp(behavior - recomputed) - 1|``, the deviation it
causes in the importance ratio ``pi_prox / pi_behav`` (Schulman et al. 2017, eq. 6;
decoupled form: Hilton et al. 2022, eq. 4). Variants:

* ``fp32``: ``gen.dtype=float32``;
* ``bf16``: ``gen.dtype=bfloat16 gen.lm_head_dtype=engine`` (weights, KV cache, residual
  stream, final norm and LM head in bf16; logits cast to fp32 for sampling);
* ``bf16+fp32head``: ``gen.dtype=bfloat16`` (the final norm and LM head in fp32);
* ``bf16+mixedhead``: ``gen.dtype=bfloat16 gen.lm_head_dtype=mixed`` (the final norm in fp32, the
  LM head with bf16 inputs and weights and fp32 sums and logits, on AMX or AVX-512 BF16; float32
  without either);
* ``bf16-weights`` (a diagnostic, no config): the fp32 engine on a copy of the model whose
  weights were rounded to bf16, which isolates the weights' rounding from the activations'
  and the KV cache's.

It also times each variant's ``generate`` (interleaved rounds, best of ``--repeats``) and
prints generated tokens/s and the ratio to fp32. Run:
``python bench/engine_logprob_accuracy.py --threads 1 [--model smollm2-135m | --model FOLDER]``
(``FOLDER``: a ``transformers`` folder, e.g. the main job's cached warm start under
``~/.cache/areal_flow/sft/``; plain prompts ``37+58=`` then). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_flow.models.logprobs import token_logprobs  # noqa: E402
from areal_flow.ops.generate import encode_prompt  # noqa: E402
from areal_flow.tasks.arithmetic import ArithmeticTask  # noqa: E402
from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams  # noqa: E402

VARIANTS = {"fp32": ("float32", "float32"), "bf16": ("bfloat16", "engine"),
            "bf16+fp32head": ("bfloat16", "float32"), "bf16+mixedhead": ("bfloat16", "mixed"),
            "bf16-weights": ("float32", "float32")}
"""variant -> (gen.dtype, gen.lm_head_dtype); bf16-weights also rounds the model's weights to bf16."""


def load(name: str):
    """``(model, tokenizer, chat)``: a folder (warm start: plain prompts) or a model name (chat prompts)."""
    if Path(name).expanduser().is_dir():
        from runtime.engines.sft import load_warm_start

        return (*load_warm_start(Path(name).expanduser()), False)
    from areal_flow.models.hf import load_model

    return (*load_model(name), True)


def recompute(model, tok, results, temperature: float, autocast: bool) -> torch.Tensor:
    """``|behavior - recomputed|`` for every response token of ``results``, ``[tokens]`` fp32."""
    seqs = [r.prompt_ids + r.output_ids for r in results]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = token_logprobs(model, ids, mask, temperature=temperature).float()
    return torch.cat([torch.tensor(r.behavior_logprobs) - ref[b, len(r.prompt_ids):len(seqs[b])]
                      for b, r in enumerate(results)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model name or transformers folder")
    parser.add_argument("--batch", type=int, default=32, help="prompts (one response each)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2, help="timed generate rounds (best kept)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok, chat = load(args.model)
    task = ArithmeticTask(seed=0, max_digits=2, prompt_style="chat" if chat else "plain")
    prompts = [encode_prompt(tok, p["prompt"]) for p in task.test_set(args.batch)]
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    rounded = copy.deepcopy(model).to(torch.bfloat16).float() if "bf16-weights" in args.variants else None
    engines = {v: GenerationEngine(rounded if v == "bf16-weights" else model, tok, max_batch_size=args.batch,
                                   dtype=VARIANTS[v][0], head_dtype=VARIANTS[v][1], seed=0) for v in args.variants}
    print(f"model {args.model}: {args.batch} responses of <= {args.max_new_tokens} tokens, T={args.temperature}, "
          f"{args.threads} threads")
    best, results = {v: float("inf") for v in engines}, {}
    for _ in range(args.repeats):
        for v, engine in engines.items():
            engine.reseed(0)
            start = time.perf_counter()
            out = engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
            seconds = time.perf_counter() - start
            tokens = sum(len(r.output_ids) for r in out)
            best[v] = min(best[v], seconds / tokens)
            results[v] = out
    for v, out in results.items():
        line = [f"{v:14s} {sum(len(r.output_ids) for r in out):5d} tokens, {1 / best[v]:8.1f} tok/s "
                f"({best.get('fp32', best[v]) / best[v]:.2f}x fp32)"]
        for name, autocast in (("fp32", False), ("bf16-autocast", True)):
            d = recompute(model, tok, out, args.temperature, autocast)
            line.append(f"vs {name} recompute: mean {d.abs().mean():.2e} max {d.abs().max():.2e} "
                        f"max|ratio-1| {(d.exp() - 1).abs().max():.2e}")
        print(" | ".join(line))


if __name__ == "__main__":
    main()
