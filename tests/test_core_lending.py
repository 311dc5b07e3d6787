"""Idle cores lent between local workers (runtime.core_lending). Expected thread counts by hand:
a worker's own share plus what the others lend now, at most the machine's cores."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from runtime.core_lending import CoreLedger

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_worker_runs_its_share_plus_what_the_waiting_ones_lend_capped_at_the_cores():
    ledger = CoreLedger(3, cores=2)
    gen, trainer, critic = (ledger.share(name, base=1) for name in ("generate/0", "train_step/0", "critic_step/0"))
    assert trainer.threads() == 1  # everyone computing: its own share
    with gen.lending():
        assert trainer.threads() == 2 and critic.threads() == 2 and gen.threads() == 1
        with critic.lending():
            assert trainer.threads() == 2  # 1 + 1 + 1 lent, but 2 cores
            assert gen.threads() == 2  # a lender counts what the others lend, never its own
    assert trainer.threads() == 1  # the lender woke: its share is back
    wide = CoreLedger(2, cores=8)
    a, b = wide.share("a", base=4), wide.share("b", base=4)
    with b.lending():
        assert a.threads() == 8


def test_a_lent_core_goes_to_one_borrower_at_a_time(threads):
    """gen:d1 + train:d1 + critic_step:d1 on 2 cores: the generator waits; the trainer takes its
    thread at its next boundary, so the critic runs its own only; the trainer waits in turn and
    the critic takes one (2 cores: own 1 + 1)."""
    ledger = CoreLedger(3, cores=2)
    gen, trainer, critic = (ledger.share(name, base=1) for name in ("generate/0", "train_step/0", "critic_step/0"))
    with gen.lending():
        assert trainer.fit() == 2 and critic.fit() == 1
        with trainer.lending():
            assert critic.fit() == 2
        assert trainer.fit() == 1  # the critic holds the spare thread now
    assert critic.fit() == 1 and trainer.fit() == 1


def test_a_restarted_worker_gets_its_old_slot_back_and_takes_its_share_again():
    ledger = CoreLedger(2, cores=2)
    gen, trainer = ledger.share("generate/0", 1), ledger.share("train_step/0", 1)
    gen.lent[gen.slot] = 1  # died while lending: the slot still says so
    assert trainer.threads() == 2
    again = ledger.share("generate/0", 1)
    assert again.slot == gen.slot and trainer.threads() == 1
    with pytest.raises(ValueError, match="'critic_step/0'"):
        ledger.share("critic_step/0", 1)


def test_fit_sets_torch_threads_and_counts_the_borrowed_phases(threads):
    ledger = CoreLedger(2, cores=2)
    gen, trainer = ledger.share("generate/0", 1), ledger.share("train_step/0", 1)
    assert trainer.fit() == 1 and torch.get_num_threads() == 1
    with gen.lending():
        assert trainer.fit() == 2 and torch.get_num_threads() == 2
        time.sleep(0.05)
    assert trainer.fit() == 1 and torch.get_num_threads() == 1
    assert trainer.report() == {"core_lending": {"own_threads": 1, "lent_s": 0.0, "phases": 3, "borrowed": 1,
                                                 "most_threads": 2}}
    assert 0.05 <= gen.report()["core_lending"]["lent_s"] < 5
    assert gen.report()["core_lending"]["most_threads"] == 1  # it never fitted: it ran its own thread


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_the_trainer_refits_at_each_layers_forward_and_backward_and_the_optimizer_step(threads):
    """3 layers: 3 forward boundaries, 3 backward ones (the gradient reaching each layer's
    output), 1 optimizer step = 7 fits; a lend that starts after the forward is taken in the
    backward already."""
    ledger = CoreLedger(2, cores=2)
    gen, trainer = ledger.share("generate/0", 1), ledger.share("train_step/0", 1)
    model = _Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer.follow(model, optimizer)
    seen = []
    model.layers[0].weight.register_hook(lambda grad: seen.append(torch.get_num_threads()))
    loss = model(torch.randn(2, 4)).sum()
    assert trainer.report()["core_lending"]["phases"] == 3 and torch.get_num_threads() == 1
    with gen.lending():  # the generator goes idle while the trainer is between forward and backward
        loss.backward()
        optimizer.step()
    assert seen == [2]  # layer 0's weight gradient, computed after the backward reached layer 0's output
    assert trainer.report()["core_lending"] == {"own_threads": 1, "lent_s": 0.0, "phases": 7, "borrowed": 4,
                                                "most_threads": 2}


@pytest.mark.slow
def test_a_local_async_run_lends_cores_between_its_workers_and_reports_it(tmp_path, warm_cache):
    """The main job at k = 2 on the local scheduler: both workers take part (their own share is
    the cores split between the two processes): the trainer fits its threads at its phases, the
    generation replica lends while it waits (at least once: for the stop, after its last group)
    and never borrows; off, neither takes part."""
    from runs import cli_run

    common = ["train.steps=2", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false",
              "async.max_staleness=2", f"out_dir={tmp_path}"]
    cli_run(REPO / "graphs/arith_grpo.py", *common, "name=lend")
    cli_run(REPO / "graphs/arith_grpo.py", *common, "name=keep", "scheduler.lend_idle_cores=false")
    workers = json.loads((tmp_path / "lend" / "summary.json").read_text())["workers"]
    own = max(1, (os.cpu_count() or 2) // 2)
    gen, trainer = workers["generate/0"]["core_lending"], workers["train_step/0"]["core_lending"]
    assert gen["own_threads"] == trainer["own_threads"] == own
    assert trainer["phases"] > 0 and own <= trainer["most_threads"] <= (os.cpu_count() or 2)
    assert gen["lent_s"] > 0 and gen["phases"] == 0
    kept = json.loads((tmp_path / "keep" / "summary.json").read_text())["workers"]
    assert all("core_lending" not in kept[name] for name in ("generate/0", "train_step/0"))
