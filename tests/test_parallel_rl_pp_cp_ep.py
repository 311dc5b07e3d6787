"""Pipeline, context and expert parallelism in the RL trainer equal the single-process step.

1. One step at k = 0 (the batch's behavior log-probs are the policy's own plus noise) of GRPO
   and of decoupled PPO (proximal log-probs recomputed, behavior weights capped) on a tiny
   policy: pp2 (1F1B, the tied embedding's two copies on the first and last stage), pp2xdp2
   (FSDP inside each stage), pp2xtp2; cp2 (Ulysses, sequence chunks; GSPO too, whose sequence
   means need whole rows) and cp2xdp2; ep2 (``d2e2``: a tiny Qwen3-MoE's 8 experts split over
   the 2 DP ranks, tokens dispatched by all-to-all) and dp4xep2 (two replicas of each expert
   block); with tp: dp2xtp2 (FSDP's 1-D and 2-D DTensors normed by mesh for the clip), cp2xtp2
   (Ulysses scattering each TP rank's heads; ``tiny-mha``, whose 4 KV heads leave 2 per TP rank),
   ep2xtp2 (``d2t2e2``; the Qwen3 per-head q/k norms' gradients summed over TP) and pp2xtp2 on the
   MoE policy (the shape ``compile`` recommends for Qwen3-30B-A3B on 4x8 H100, scaled down:
   experts replicated on each TP rank); dp2 with a token budget that gives the two ranks different micro-batch counts
   (evened out by splitting): the loss, the merged metrics, the gradients and the gathered
   weights after the AdamW step match ``BaseAlgorithm.update_parameters`` on one process, to
   fp32 reduction order (``rl_step_cases``: loss rtol 1e-5, gradients rtol 1e-4 / atol 1e-7,
   weights within the Adam error bound).
2. The arithmetic GRPO graph trains end to end with its train_step on 2 pipeline stages, and
   its MoE variant (``graphs/arith_grpo_moe.py``) with its experts split over 2 ranks, each
   with generation in a third process; for 2 steps, ``train:t2c2`` (``tiny-mha``) and the MoE
   graph's ``train:d2t2e2`` on 4 ranks and a fifth process: every sample trained exactly once, staleness <= k,
   every saved weight moved (those of the other stage or of the other rank's experts too).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from areal_flow.config_load import load_config
from areal_flow.models.tiny import build_model
from compiler.strategy import ParallelStrategy
from rl_step_cases import METRICS, assert_step_matches, policy_folder, rl_batch, settings, single_process_step
from runtime.model_source import load_pretrained
from runtime.parallel.launch import spawn_workers
from runtime.parallel.weight_sync import full_named_tensors
from runtime.parallel_trainer import RankTrainer
from runs import records as trained_records

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = ("grpo", "decoupled_ppo", "gspo")
TWO_RANKS = {  # case -> (algorithm, strategy, policy[, TrainSettings changes]); GSPO: per-sequence means and ratios over whole rows under cp
    **{f"{algorithm}-pp2": (algorithm, "p2", "dense") for algorithm in ("grpo", "decoupled_ppo")},
    "grpo-pp2-packed": ("grpo", "p2", "dense", {"pack_sequences": True}),  # stages run packed rows padded
    **{f"{algorithm}-cp2": (algorithm, "c2", "dense") for algorithm in ALGORITHMS},
    **{f"{algorithm}-ep2": (algorithm, "d2e2", "moe") for algorithm in ("grpo", "decoupled_ppo")},
    # a budget of 16 tokens gives rank 0's rows (4, 5, 7, 6 tokens) 2 micro-batches and rank 1's
    # (6, 11, 7, 8) 3, padded and packed alike: rank 0 splits one to run 3 as well
    "grpo-dp2-token-budget": ("grpo", "d2", "dense", {"max_tokens_per_micro_batch": 16}),
    "grpo-dp2-packed-token-budget": ("grpo", "d2", "dense", {"max_tokens_per_micro_batch": 16,
                                                             "pack_sequences": True}),
}
FOUR_RANKS = {  # dp4 x ep2: each expert block has two replicas (edp), whose gradients are summed
    **{f"{algorithm}-pp2xdp2": (algorithm, "d2p2", "dense") for algorithm in ("grpo", "decoupled_ppo")},
    "grpo-cp2xdp2": ("grpo", "d2c2", "dense"), "grpo-pp2xtp2": ("grpo", "t2p2", "dense"),
    "grpo-dp4xep2": ("grpo", "d4e2", "moe"),
    "grpo-dp2xtp2": ("grpo", "d2t2", "dense"),
    **{f"{algorithm}-cp2xtp2": (algorithm, "t2c2", "mha") for algorithm in ("grpo", "decoupled_ppo")},
    **{f"{algorithm}-ep2xtp2": (algorithm, "d2t2e2", "moe") for algorithm in ("grpo", "decoupled_ppo")},
    "grpo-pp2xtp2-moe": ("grpo", "t2p2", "moe"),
}
# 2 layers, tied / Qwen3-MoE, 4 layers of 8 experts, top-2, tied / tiny-s with 4 KV heads (cp2 x tp2)
PRESETS = {"dense": "tiny-s", "moe": "tiny-moe", "mha": "tiny-mha"}


def _steps_on_ranks(rank: int, world_size: int, policies: dict, cases: dict) -> dict | None:
    """Worker: one RL step per case, each on a fresh model. Returns the stats, the gathered
    weights and this rank's stage's full gradients (every rank joins the gathers)."""
    out = {}
    for case, (algorithm, text, kind, *fields) in cases.items():
        folder, batch = policies[kind]
        trainer = RankTrainer.build(settings(folder, algorithm, **(fields or [{}])[0]), ParallelStrategy.parse(text))
        stats = trainer.step(batch)
        grads = dict(full_named_tensors(trainer.parallel.module, grads=True))
        coordinate = trainer.parallel.coordinate
        out[case] = {"stats": stats, "state": trainer.gather_weights(),
                     "grads": grads if coordinate["dp"] == coordinate["cp"] == coordinate["tp"] == 0 else {}}
    return out


def _merged(per_rank: list[dict], case: str) -> dict:
    """Rank 0's stats and weights, the stages' gradients in rank (= stage) order."""
    grads = {}
    for result in per_rank:
        grads.update(result[case]["grads"])
    return {**per_rank[0][case], "grads": grads}


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """kind -> (folder, batch, {algorithm: single-process step})."""
    torch.set_num_threads(1)
    out = {}
    for kind, preset in PRESETS.items():
        folder = policy_folder(tmp_path_factory.mktemp(kind), preset)
        batch = rl_batch(folder)
        out[kind] = folder, batch, {algorithm: single_process_step(folder, batch, algorithm) for algorithm in ALGORITHMS}
    return out


def _spawn(policies: dict, cases: dict, world_size: int) -> list[dict]:
    inputs = {kind: (folder, batch) for kind, (folder, batch, _) in policies.items()}
    return spawn_workers(_steps_on_ranks, world_size, (inputs, cases), backend="gloo")


@pytest.fixture(scope="module")
def two_rank_steps(policies):
    return _spawn(policies, TWO_RANKS, 2)


@pytest.fixture(scope="module")
def four_rank_steps(policies):
    return _spawn(policies, FOUR_RANKS, 4)


def _check(got: dict, ref: dict, algorithm: str) -> None:
    if algorithm != "decoupled_ppo":
        assert ref["stats"]["clip_frac"] > 0  # the clipped branch of the objective is exercised
        assert_step_matches(got, ref)
    else:  # the proximal policy is the current one at the step start: the cap, not the clip, acts
        assert ref["stats"]["behavior_imp_weight_capped_frac"] > 0
        assert_step_matches(got, ref, metrics=(*METRICS, "behavior_imp_weight_capped_frac"))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TWO_RANKS))
def test_two_rank_rl_step_matches_single_process(policies, two_rank_steps, case):
    algorithm, _, kind, *_ = TWO_RANKS[case]
    _check(_merged(two_rank_steps, case), policies[kind][2][algorithm], algorithm)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FOUR_RANKS))
def test_four_rank_rl_step_matches_single_process(policies, four_rank_steps, case):
    algorithm, _, kind = FOUR_RANKS[case]
    _check(_merged(four_rank_steps, case), policies[kind][2][algorithm], algorithm)


def _run_and_check(tmp_path: Path, graph: str, strategy: str, overrides: list[str], steps: int = 3) -> None:
    """Run ``graph`` for ``steps`` steps at k = 1 with its train_step on the ranks of ``strategy``
    and the generator in one more process; check the accounting and that the saved weights moved."""
    from areal_flow.cli import default_config_path, load_flow
    from areal_flow.cli.run import run_experiment

    k, world = 1, ParallelStrategy.parse(strategy).world_size
    flow = load_flow(REPO / "graphs" / graph)
    cfg = load_config(default_config_path(flow, None), [
        f"train.steps={steps}", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false",
        f"async.max_staleness={k}", f"cluster.n_gpus_per_node={world + 1}", "train.weight_decay=0.1",
        f"out_dir={tmp_path}", *overrides])
    summary = run_experiment(flow(cfg), cfg, show_progress=False)
    out = tmp_path / flow.name
    plan = json.loads((out / "plan.json").read_text())
    assert {n["name"]: n["strategy"] for n in plan["nodes"]}["train_step"] == strategy
    trainer = summary["workers"]["train_step/0"]
    assert (trainer["steps"], trainer["consumed"], trainer["world_size"]) == (steps, steps * 2 * 4, world)
    records = trained_records(out)
    # every sample of the steps x 2 groups x 4 samples trained exactly once, in its step's slot
    assert len(records) == len({(r["group_id"], r["sample_id"]) for r in records}) == steps * 2 * 4
    assert all(r["group_id"] // 2 == r["step"] for r in records)
    assert all(r["staleness"] <= k for r in records)
    assert summary["workers"]["generate/0"]["final_version"] >= 1
    # rank 0 saved weights gathered from both ranks: at least AdamW's decay moved those it does not hold
    model, _ = load_pretrained(out / "model")
    initial, _ = load_pretrained(summary["initial_model"])
    moved = [name for name, value in model.state_dict().items() if not torch.equal(value, initial.state_dict()[name])]
    assert len(moved) == len(model.state_dict()), sorted(set(model.state_dict()) - set(moved))


@pytest.mark.slow
@pytest.mark.ci
def test_arith_grpo_trains_on_two_pipeline_stages(tmp_path, warm_cache):
    _run_and_check(tmp_path, "arith_grpo.py", "d1p2", ["compile.allocation=train:p2 + gen:d1"])


@pytest.mark.slow
def test_arith_grpo_moe_trains_with_its_experts_on_two_ranks(tmp_path, warm_cache):
    _run_and_check(tmp_path, "arith_grpo_moe.py", "d2e2", [])  # the yaml's train:d2e2 + gen:d1


@pytest.mark.slow
@pytest.mark.parametrize(("graph", "strategy", "overrides"), [
    ("arith_grpo.py", "d1t2c2", ["model.path=tiny-mha", "compile.allocation=train:t2c2 + gen:d1"]),
    ("arith_grpo_moe.py", "d2t2e2", ["compile.allocation=train:d2t2e2 + gen:d1"]),
])
def test_a_tp_combination_trains_two_steps_through_the_cli(tmp_path, warm_cache, graph, strategy, overrides):
    """cp x tp and ep x tp (the rules widened with the reference steps above), 4 trainer ranks."""
    _run_and_check(tmp_path, graph, strategy, overrides, steps=2)


@pytest.mark.parametrize(("preset", "strategy", "rows", "budget", "rule"), [
    ("tiny-s", "d1p2c2", 8, 0, r"rule 'cp-without-pp': cp=2 with pp=2: .* runs with dp and tp"),
    ("tiny-moe", "d2p2e2", 8, 0, r"rule 'ep-without-pp-cp': ep=2 with pp or cp: .* over dp ranks, with or without tp"),
    ("tiny-moe", "d2c2e2", 8, 0, r"rule 'ep-without-pp-cp'"),
    ("tiny-s", "d1t2c2", 8, 0, r"rule 'ulysses-heads': cp=2 must divide the heads \(2\) and KV heads \(1\) per TP"),
    ("tiny-mha", "d1t2c2", 8, 0, None), ("tiny-moe", "d2t2e2", 8, 0, None), ("tiny-moe", "d1t2p2", 8, 0, None),
    ("tiny-s", "d2p2", 2, 0, r"rule 'rows-fill-pp': 1 sequences per DP rank cannot fill pp=2 pipeline micro-batches"),
    ("tiny-s", "d1p2", 8, 64, r"rule 'token-budget-no-pp': train.max_tokens_per_micro_batch=64 with pp=2"),
    ("tiny-s", "d2", 8, 0, None), ("tiny-s", "d1p2", 8, 0, None), ("tiny-s", "d2c2", 8, 0, None),
    ("tiny-moe", "d2e2", 8, 0, None), ("tiny-s", "d1t2p2", 8, 0, None), ("tiny-s", "d2", 8, 64, None),
])
def test_the_rl_trainer_refuses_only_what_it_cannot_run(preset, strategy, rows, budget, rule):
    """The one predicate (compiler.executable), on the shape of the model's own config."""
    from compiler.executable import ExecutableError, NodeFacts, check_node
    from runtime.parallel.validate import model_shape

    shape = model_shape(build_model(preset, 50).config)
    check = lambda: check_node(NodeFacts("train_step", "training", ParallelStrategy.parse(strategy),  # noqa: E731
                                         shape=shape, rows=rows, token_budget=budget))
    if rule is None:
        check()
    else:
        with pytest.raises(ExecutableError, match=rule):
            check()


@pytest.mark.slow
def test_a_d2e2_checkpoint_holds_every_expert_and_resumes_bit_for_bit(tmp_path, warm_cache):
    """Each ep rank's expert block is a plain tensor under the same name on both ranks; DCP took
    it as replicated and kept rank 0's block only, so a resume gave rank 1 experts 0-3 in place of
    4-7 (48 expert tensors of the final model differed). Now the checkpoint holds the global
    ``[8, ...]`` tensor in two chunks and a k = 0 resume from it ends with the uninterrupted
    run's weights bit for bit (resume is exact at k = 0: docs/RESUME.md)."""
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from areal_flow.cli import default_config_path, load_flow
    from areal_flow.cli.run import run_experiment

    flow = load_flow(REPO / "graphs/arith_grpo_moe.py")  # the yaml's train:d2e2 + gen:d1, 8 experts
    cfg = load_config(default_config_path(flow, None), [
        "train.steps=2", "train.checkpoint_every=1", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10",
        "eval.enabled=false", "async.max_staleness=0", f"out_dir={tmp_path}", "name=ep"])
    run_experiment(flow(cfg), cfg, show_progress=False)
    out = tmp_path / "ep"
    meta = FileSystemReader(str(out / "checkpoints/version_1/trainer_dcp")).read_metadata().state_dict_metadata
    for key in ("model.model.layers.0.mlp.experts.down_proj",
                "optimizer.state.model.layers.0.mlp.experts.gate_up_proj.exp_avg"):
        assert meta[key].size[0] == 8 and sorted(c.offsets[0] for c in meta[key].chunks) == [0, 4], key
    final = load_file(out / "model/model.safetensors")
    shutil.rmtree(out / "checkpoints/version_2")
    shutil.rmtree(out / "model")
    done = subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", "--resume", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # the folder's own plan.json
    said = done.stdout + done.stderr
    assert done.returncode == 0 and f"resuming {out} from version_1" in said, said[-2000:]
    resumed = load_file(out / "model/model.safetensors")
    assert sorted(resumed) == sorted(final) and [k for k in final if not torch.equal(final[k], resumed[k])] == []
