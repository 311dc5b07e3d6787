"""Invalid strategies fail in the parent, before any worker process starts, naming the rule."""

from __future__ import annotations

import pytest

from compiler.strategy import ParallelStrategy, StrategyError
from runtime.parallel import launch
from runtime.parallel.launch import WorkerError, launch_strategy, spawn_workers
from test_parallel_helpers import tiny_config


@pytest.fixture
def no_process_start(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(launch.mp, "start_processes", refuse)


def _never_called(rank: int, world_size: int) -> None:
    raise AssertionError("worker ran")


@pytest.mark.parametrize(
    ("strategy", "kind", "rule"),
    [
        # tiny model: 4 heads, 2 KV heads, 4 layers, dense or 4 experts
        (ParallelStrategy(tp=3), "dense", r"tp=3 must divide the attention heads \(4\) and KV heads \(2\)"),
        (ParallelStrategy(tp=4), "dense", r"tp=4 must divide the attention heads \(4\) and KV heads \(2\)"),
        (ParallelStrategy(pp=3), "dense", r"pp=3 must divide the number of layers \(4\)"),
        (ParallelStrategy(dp=2, ep=2), "dense", r"ep=2 needs a Mixture-of-Experts model"),
        (ParallelStrategy(dp=8, ep=8), "moe", r"ep=8 must divide the number of experts \(4\)"),
        # Ulysses: 4 heads / 2 KV heads per TP rank cannot be scattered over 4 cp ranks
        (ParallelStrategy(cp=4), "dense", r"cp=4 must divide the heads \(4\) and KV heads \(2\) per TP rank"),
        (ParallelStrategy(tp=2, cp=2), "dense", r"cp=2 must divide the heads \(2\) and KV heads \(1\) per TP rank"),
    ],
)
def test_invalid_strategy_fails_before_any_process(no_process_start, strategy, kind, rule):
    with pytest.raises(StrategyError, match=rule):
        launch_strategy(_never_called, strategy, tiny_config(kind))


def test_tied_embeddings_reach_the_launcher_for_pp_and_tp(no_process_start):
    config = tiny_config("dense")
    config.tie_word_embeddings = True
    for strategy in (ParallelStrategy(pp=2), ParallelStrategy(tp=2)):  # pp sums the two copies' grads, TP keeps one
        with pytest.raises(AssertionError, match="a worker process was started"):
            launch_strategy(_never_called, strategy, config)


def test_valid_strategy_reaches_the_launcher(no_process_start):
    with pytest.raises(AssertionError, match="a worker process was started"):
        launch_strategy(_never_called, ParallelStrategy(dp=2, tp=2), tiny_config("dense"))


def _fail_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        raise KeyError("boom in the worker")


@pytest.mark.slow
def test_worker_error_names_rank_and_cause():
    with pytest.raises(WorkerError, match=r"(?s)rank0.*KeyError: 'boom in the worker'"):
        spawn_workers(_fail_on_rank_0, 1)
