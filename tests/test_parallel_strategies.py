"""Each strategy's loss, gradients and AdamW weights equal a single-process run (gloo, CPU).

Every strategy runs twice: as is, and with gradient accumulation over 2
micro-batches plus activation checkpointing (pipeline runs always use 2
micro-batches). Tolerances and their reasons: ``test_parallel_helpers``.
The 2-process cases of one model share one set of worker processes (process
start dominates the run time on 2 CPU cores).
"""

from __future__ import annotations

import pytest
import torch

from compiler.strategy import ParallelStrategy
from runtime.parallel.apply import ParallelConfig
from runtime.parallel.launch import spawn_workers
from test_parallel_helpers import assert_matches_reference, build_model, parallel_step, reference_step, tiny_batch

PLAIN = ParallelConfig()
ACCUMULATE_AC = ParallelConfig(n_microbatches=2, activation_checkpointing=True)
DENSE_2 = {
    "dp2": ("d2", PLAIN),
    "dp2-accumulate-ac": ("d2", ACCUMULATE_AC),
    "tp2": ("t2", PLAIN),
    "tp2-accumulate-ac": ("t2", ACCUMULATE_AC),
    "pp2-gpipe": ("p2", ParallelConfig(n_microbatches=2, pp_schedule="gpipe")),
    "pp2-1f1b": ("p2", ParallelConfig(n_microbatches=2, pp_schedule="1f1b")),
    "pp2-1f1b-ac-uneven-split": ("p2", ParallelConfig(n_microbatches=2, layers_per_stage=[1, 3], activation_checkpointing=True)),
    "cp2": ("c2", PLAIN),
    "cp2-accumulate-ac": ("c2", ACCUMULATE_AC),
}
MOE_2 = {
    "ep2": ("d2e2", PLAIN),
    "ep2-accumulate-ac": ("d2e2", ACCUMULATE_AC),
}


def _run(kind: str, cases: dict, world_size: int) -> tuple[dict, dict]:
    torch.set_num_threads(1)
    state, batch = build_model(kind).state_dict(), tiny_batch()
    specs = [
        {"strategy": ParallelStrategy.parse(text), "kind": kind, "state": state, "batch": batch, "config": config}
        for text, config in cases.values()
    ]
    per_rank = spawn_workers(parallel_step, world_size, (specs,))
    results = {name: [rank[index] for rank in per_rank] for index, name in enumerate(cases)}
    return results, reference_step(kind, state, batch)


@pytest.fixture(scope="module")
def dense_runs():
    return _run("dense", DENSE_2, 2)


@pytest.fixture(scope="module")
def moe_runs():
    return _run("moe", MOE_2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DENSE_2))
def test_dense_strategy_matches_single_process(dense_runs, case):
    results, reference = dense_runs
    assert_matches_reference(results[case], reference)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MOE_2))
def test_expert_parallel_matches_single_process(moe_runs, case):
    results, reference = moe_runs
    assert_matches_reference(results[case], reference)
    # every one of the 4 experts (2 per rank) received tokens, so the all-to-all dispatch was exercised
    expert_grads = results[case][0]["grads"]["model.layers.0.mlp.experts.down_proj"]
    assert expert_grads.shape[0] == 4
    assert all(expert_grads[e].abs().sum() > 0 for e in range(4))


@pytest.mark.slow
def test_pp2_with_a_tied_embedding_matches_single_process():
    """The tied matrix's two copies (embedding on the first stage, LM head on the last) sum their
    gradients, so both hold the tied parameter's gradient and stay equal after AdamW."""
    results, reference = _run("dense-tied", {"pp2-tied": ("p2", ParallelConfig(n_microbatches=2))}, 2)
    first, last = results["pp2-tied"]
    for key in ("grads", "params"):  # one process names the tied parameter once
        assert torch.equal(last[key].pop("lm_head.weight"), first[key]["model.embed_tokens.weight"]), key
    assert_matches_reference([first, last], reference)


@pytest.mark.slow
def test_dp2_tp2_on_four_processes_matches_single_process():
    cases = {"dp2xtp2": ("d2t2", PLAIN), "dp2xtp2-accumulate-ac": ("d2t2", ACCUMULATE_AC)}
    results, reference = _run("dense", cases, 4)
    for name in cases:
        assert_matches_reference(results[name], reference)
    # mesh [pp=1, dp=2, cp=1, tp=2], tp innermost: rank = 2 * dp_index + tp_index
    groups = [rank["groups"] for rank in results["dp2xtp2"]]
    assert [g["tp"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["dp_cp"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]
