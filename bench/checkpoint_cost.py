"""Benchmark (not a test): what a resumable checkpoint costs over a weights-only save.

For one model (``tiny-arith`` built in code, or any folder/preset ``resolve_folder`` knows,
e.g. ``smollm2-135m``) with AdamW moments after one step, it alternates ``--repeats`` times:

* ``weights``: the policy in ``transformers`` format plus its tokenizer (what a checkpoint
  held before ``runtime.checkpoint``);
* ``resumable``: ``runtime.checkpoint.write_checkpoint`` of the same, plus the optimizer's
  state, the RNG states, fsync of every file and the folder, the manifest and the rename;

and prints each variant's median seconds, their ratio (resumable / weights), the folder sizes
(MiB) and the median seconds to load a resumable checkpoint back (weights + optimizer).

    python bench/checkpoint_cost.py [--model tiny-arith] [--repeats 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from runtime.checkpoint import capture_rng, read_state, write_checkpoint  # noqa: E402


def _model(spec: str):
    from areal_flow.models.tokenizer import build_char_tokenizer

    if spec == "tiny-arith":
        from areal_flow.models.tiny import build_model

        tok = build_char_tokenizer()
        return build_model("tiny-arith", len(tok), seed=0), tok
    from areal_flow.models.hf import resolve_folder
    from runtime.model_source import load_pretrained

    return load_pretrained(resolve_folder(spec))


def _size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-arith")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = _model(args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, len(tok), (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # AdamW moments exist, as after a train step

    def weights(folder: Path) -> None:
        model.save_pretrained(folder)
        tok.save_pretrained(folder)

    times: dict[str, list[float]] = {"weights": [], "resumable": [], "load": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(args.repeats):
            started = time.perf_counter()
            weights(root / f"plain_{i}")
            times["weights"].append(time.perf_counter() - started)
            started = time.perf_counter()
            folder = write_checkpoint(root / "checkpoints", i, weights,
                                      {"version": i, "rng": capture_rng(),
                                       "optimizers": {"train_step": optimizer.state_dict()}}, next_index=0)
            times["resumable"].append(time.perf_counter() - started)
            started = time.perf_counter()
            from runtime.model_source import load_pretrained

            model.load_state_dict(load_pretrained(folder)[0].state_dict())
            optimizer.load_state_dict(read_state(folder)["optimizers"]["train_step"])
            times["load"].append(time.perf_counter() - started)
        sizes = (_size_mib(root / "plain_0"), _size_mib(root / "checkpoints" / "version_0"))
        shutil.rmtree(root / "checkpoints")
    med = {k: statistics.median(v) for k, v in times.items()}
    n = sum(p.numel() for p in model.parameters())
    print(f"model {args.model}: {n / 1e6:.2f} M parameters, {args.repeats} repeats, alternating")
    print(f"weights-only save:      median {med['weights']:.3f} s  ({sizes[0]:.1f} MiB)")
    print(f"resumable checkpoint:   median {med['resumable']:.3f} s  ({sizes[1]:.1f} MiB)")
    print(f"ratio resumable/weights: {med['resumable'] / med['weights']:.2f}")
    print(f"load back (weights + optimizer): median {med['load']:.3f} s")


if __name__ == "__main__":
    main()
