"""Non-finite train steps (``runtime.nonfinite``): skipped, counted, kept on disk, and a run
of them stops the run naming the node and the steps.

* the guard alone: a finite step counts nothing and writes nothing; NaN/inf steps are
  counted, kept in the record format, and the ``max_nonfinite_steps``-th in a row raises;
  a finite step in between resets the run of them;
* the train_step executor of a compiled plan, with a NaN in a norm weight (every token's
  loss is NaN): the optimizer does not step (weights bit-identical), the step's stats say
  so and its batch is on disk; the second such step in a row stops with the node named;
* ``train.max_nonfinite_steps`` below 1 or not an integer is refused naming the key.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from areal_flow.config import ConfigError

from areal_flow.config_load import load_config
from areal_flow.values import Advantages
from runtime.nonfinite import NonFiniteGuard, NonFiniteStepError

REPO = Path(__file__).resolve().parents[1]
TINY = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false"]


def _value(groups: dict[int, int]) -> Advantages:
    """An ``advantages`` value whose trajectories belong to ``groups`` (index -> attempt)."""
    trajectories = [SimpleNamespace(group_id=i, meta={"attempt": a}, versions=[0, 0]) for i, a in groups.items()
                    for _ in range(2)]
    return Advantages({"input_ids": torch.zeros(len(trajectories), 3, dtype=torch.long)}, trajectories)


def test_the_guard_counts_keeps_and_stops_after_max_steps_in_a_row(tmp_path):
    guard = NonFiniteGuard("train_step", "advantage", tmp_path, max_steps=2, port="advantages", seed=7)
    folder = tmp_path / "nonfinite" / "advantage-train_step"
    assert guard.check(0, {"loss": 0.5, "grad_norm": 1.0}, _value({0: 1})) == {"nonfinite_steps": 0.0}
    assert not folder.exists()  # nothing kept for a finite step
    assert guard.check(1, {"loss": float("nan"), "grad_norm": float("nan")}, _value({2: 1, 3: 2})) == \
        {"nonfinite_steps": 1.0}
    kept = torch.load(folder / "step_1.pt", weights_only=False)  # runtime.record's step file
    assert kept["step"] == 1 and kept["indices"] == [2, 3] and kept["attempts"] == [1, 2]
    assert kept["versions"] == [[0, 0]] * 4 and kept["value"].batch["input_ids"].shape == (4, 3)
    assert (folder / "meta.json").is_file()
    # a finite step resets the run: steps 1 and 3 are not in a row
    assert guard.check(2, {"loss": 0.1, "grad_norm": 0.3}, _value({4: 1})) == {"nonfinite_steps": 1.0}
    assert guard.check(3, {"loss": 0.1, "grad_norm": float("inf")}, _value({6: 1})) == {"nonfinite_steps": 2.0}
    with pytest.raises(NonFiniteStepError, match=r"train_step 'train_step': 2 steps in a row .*steps 3, 4; "
                                                 r"at step 4: loss inf\)"):
        guard.check(4, {"loss": float("inf"), "grad_norm": 2.0}, _value({8: 1}))
    assert guard.kinds["nonfinite_step"] == 3  # steps 1, 3 and 4
    assert sorted(p.name for p in folder.glob("step_*.pt")) == ["step_1.pt", "step_3.pt", "step_4.pt"]


def test_batches_kept_earlier_stay(tmp_path):
    NonFiniteGuard("train_step", "advantage", tmp_path, max_steps=5, port="advantages").check(0, {"loss": math.nan}, _value({0: 1}))
    NonFiniteGuard("train_step", "advantage", tmp_path, max_steps=5, port="advantages").check(9, {"loss": math.nan}, _value({1: 1}))
    assert sorted(p.name for p in (tmp_path / "nonfinite/advantage-train_step").glob("*.pt")) == \
        ["step_0.pt", "step_9.pt"]


@pytest.mark.parametrize("bad", ["0", "-1", "1.5", "many"])
def test_max_nonfinite_steps_must_be_a_positive_integer(bad):
    with pytest.raises(ConfigError, match="train.max_nonfinite_steps"):
        load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, f"train.max_nonfinite_steps={bad}"])


def _train_executor(tmp_path: Path, *overrides: str):
    from areal_flow.cli import load_flow
    from areal_flow.tasks.catalog import build_task
    from compiler.program import compile_program
    from runtime.executors.train import TrainStepExecutor
    from runtime.model_source import prepare_models
    from runtime.workers import WorkerSpec, worker_context

    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, f"out_dir={tmp_path}", "name=nf",
                                                          "train.max_nonfinite_steps=2", *overrides])
    plan = compile_program(load_flow(REPO / "graphs/arith_grpo.py")(cfg), cfg)
    train = next(n for n in plan.nodes if n.op == "train_step")
    folders = prepare_models(plan, build_task(next(n for n in plan.nodes if n.op == "dataset").attrs, 1))
    ctx = worker_context(WorkerSpec(plan=plan, folders=folders, out_dir=str(tmp_path / "nf"), group="", rank=0,
                                    inbox="", control=""))
    return TrainStepExecutor(ctx.node(train.name), ctx), train


def _advantages(vocab: int) -> Advantages:
    """Two sequences of 3 prompt + 3 response tokens, advantages +1 and -1 on the response."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 6), generator=gen)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1]] * 2, dtype=torch.float32)
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, 6, dtype=torch.long), "loss_mask": mask,
             "behavior_logprobs": -1.0 * mask, "advantages": torch.tensor([[1.0], [-1.0]]) * mask,
             "rewards": torch.tensor([1.0, 0.0])}
    trajectories = [SimpleNamespace(group_id=5, meta={"attempt": 1}, versions=[0, 0, 0]) for _ in range(2)]
    return Advantages(batch, trajectories)


def _bits(state: dict) -> dict:
    """Weights as integer bit patterns: NaN compares equal to itself."""
    return {k: v.detach().clone().view(torch.int32 if v.element_size() == 4 else torch.int16) for k, v in state.items()}


@pytest.mark.slow
def test_a_nan_loss_skips_the_update_keeps_the_batch_and_stops_the_second_time(tmp_path, warm_cache):
    torch.set_num_threads(1)
    executor, node = _train_executor(tmp_path)
    adv = _advantages(executor.model.config.vocab_size)
    finite = executor.run({"advantages": adv}, {"step": 0, "publish": False})["stats"].metrics
    assert finite["nonfinite_steps"] == 0.0 and finite["step_skipped"] == 0.0
    norm = next(p for name, p in executor.model.named_parameters() if name.endswith("norm.weight"))
    with torch.no_grad():
        norm[0] = float("nan")  # every position's hidden state, hence every token's loss, is NaN
    before = _bits(executor.model.state_dict())
    stats = executor.run({"advantages": adv}, {"step": 1, "publish": False})["stats"].metrics
    assert math.isnan(stats["loss"]) and stats["step_skipped"] == 1.0 and stats["nonfinite_steps"] == 1.0
    after = _bits(executor.model.state_dict())
    assert all(torch.equal(before[k], after[k]) for k in before)  # the optimizer did not step
    kept = torch.load(tmp_path / "nf/nonfinite" / f"{node.inputs['advantages'][0]}-{node.name}/step_1.pt",
                      weights_only=False)
    assert kept["indices"] == [5] and torch.equal(kept["value"].batch["input_ids"], adv.batch["input_ids"])
    assert executor.monitor.kinds == {"nonfinite_step": 1}  # -> "<node>/failures" in summary.json
    with pytest.raises(NonFiniteStepError, match=rf"train_step '{node.name}': 2 steps in a row .*steps 1, 2;"):
        executor.run({"advantages": adv}, {"step": 2, "publish": False})
