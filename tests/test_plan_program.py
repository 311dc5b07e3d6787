"""Every parameter decided once, in the compiler, and carried in the plan (issue 23).

* B has one key (``train.batch_size``; ``compile.prompts_per_step`` is its alias) and one
  plan field (``batch_groups`` on the data edge into the train_step); k one default (2);
* each train_step's whole loss config is merged at compile time into ``attrs.loss``, with the
  decoupled PPO loss on when samples may be stale (k >= 1) or a line saying why it is off;
  the executors read it from the plan;
* user-registered algorithms and estimators travel by value in the plan;
* a hand-edited plan (B, a weight route) is what runs (slow: from the run's records).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from areal_flow import Model, flow, ops
from areal_flow.algorithms.config import LossConfig
from areal_flow.cli import load_flow
from areal_flow.config import ExperimentConfig
from areal_flow.config_compile import CompileConfigError
from areal_flow.config_load import load_config
from compiler.plan import Plan, encode_value
from compiler.program import compile_program
from runs import records as trained_records
from user_algorithm import check_user_run, write_user_graph

REPO = Path(__file__).resolve().parents[1]
TINY = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false"]
CLI = [sys.executable, "-m", "areal_flow.cli"]


def _compile(graph: str, *overrides: str) -> Plan:
    cfg = load_config(REPO / f"graphs/{graph}.yaml", [*TINY, *overrides])
    return compile_program(load_flow(REPO / f"graphs/{graph}.py")(cfg), cfg)


def _train_step_at(graph: str) -> str:
    """``graphs/<graph>.py:<line>`` of its ``ops.train_step`` call (the node's source)."""
    return _call_at(graph, "ops.train_step(")


def _call_at(graph: str, call: str) -> str:
    """``graphs/<graph>.py:<line>`` of the first line holding ``call``."""
    lines = (REPO / f"graphs/{graph}.py").read_text().splitlines()
    return f"graphs/{graph}.py:{next(i for i, line in enumerate(lines, 1) if call in line)}"


def _loss(**fields) -> dict:
    return dataclasses.asdict(LossConfig(**fields))


# ------------------------------------------------------------------------ k and B
def test_b_has_one_key_and_one_plan_field():
    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, "compile.prompts_per_step=3"])
    assert cfg.train.batch_size == 3 and not hasattr(cfg.compile, "prompts_per_step")  # the old name is an alias
    plan = compile_program(load_flow(REPO / "graphs/arith_grpo.py")(cfg), cfg)
    assert [(e.src, e.dst, e.batch_groups) for e in plan.edges if e.batch_groups is not None] == [
        ("advantage", "train_step", 3)]
    assert plan.batch_groups == 3 and "batch_groups" not in plan.workload
    assert plan.workload["n_sequences"] == 3 * 4  # B x gen.n_samples, what the time model assumed


def test_k_has_one_default():
    @flow
    def no_bound_given(cfg):
        policy = Model("policy", "tiny-arith")
        rollout = ops.generate(policy, ops.dataset({"name": "arithmetic"}))
        stats = ops.train_step(policy, ops.advantage(rollout, ops.reward(rollout)))
        ops.sync_weights(policy, to=rollout)
        return stats

    bound = next(e.max_staleness for e in no_bound_given(None).edges if e.dst == "train_step")
    assert bound == ExperimentConfig().async_.max_staleness == 2


# ------------------------------------------------------------------- loss config
def test_the_whole_loss_config_is_merged_once_into_the_plan():
    # DAPO's clip-higher 0.28 (its row), and with k = 2 (the yaml) AReaL's decoupled loss
    assert _compile("arith_dapo").node("train_step").attrs["loss"] == _loss(clip_eps_high=0.28, use_decoupled_loss=True)
    sync = _compile("arith_dapo", "async.max_staleness=0")
    assert sync.node("train_step").attrs["loss"] == _loss(clip_eps_high=0.28) and sync.warnings == ()
    tuned = _compile("arith_grpo", "train.loss.clip_eps_low=0.1", "train.loss.kl_coef=0.5")
    assert tuned.node("train_step").attrs["loss"] == _loss(clip_eps_low=0.1, kl_coef=0.5, use_decoupled_loss=True)


def test_an_off_policy_correction_left_off_is_said_in_one_line():
    off = _compile("arith_grpo", "train.loss.use_decoupled_loss=false")
    assert off.node("train_step").attrs["loss"]["use_decoupled_loss"] is False
    assert [w for w in off.warnings if "off-policy" in w] == [
        f"node 'train_step' (train_step, {_train_step_at('arith_grpo')}) trains samples up to k=2 versions old with no "
        "off-policy correction: train.loss sets use_decoupled_loss=false (the PPO ratio is taken against the "
        "behavior policy)"]
    m2po = _compile("arith_m2po")
    assert m2po.node("train_step").attrs["loss"]["use_decoupled_loss"] is False
    assert any("without the decoupled PPO loss: its policy loss 'm2po' takes the ratio its own way" in w
               for w in m2po.warnings)


def test_a_group_baseline_with_one_sample_a_prompt_is_said_in_one_line():
    """GRPO's advantage (r - mean of the group) / std is 0 for a group of one: nothing learns."""
    one = _compile("arith_grpo", "gen.n_samples=1")
    assert [w for w in one.warnings if "n_samples=1" in w] == [
        f"node 'advantage' (advantage, {_call_at('arith_grpo', 'ops.advantage(')}): estimator 'grpo' subtracts the mean of each prompt's group, but "
        "'generate' samples n_samples=1 a prompt: every advantage is 0 and the policy does not learn; raise "
        "gen.n_samples (4-16 is usual)"]
    assert not [w for w in _compile("arith_grpo", "gen.n_samples=2").warnings if "n_samples" in w]


def test_a_critic_keeps_its_loss_without_the_correction():
    plan = _compile("arith_ppo")
    assert plan.node("train_step").attrs["loss"] == _loss(use_decoupled_loss=True)
    assert plan.node("critic_step").attrs["loss"] == _loss()  # value clip 0.2 and the rest: LossConfig's
    assert plan.warnings == ()


def test_a_loss_the_algorithm_cannot_take_is_refused_when_compiling():
    where = re.escape(_train_step_at("arith_grpo"))
    with pytest.raises(CompileConfigError, match=rf"^train.loss for node 'train_step' \(train_step, {where}\): "
                                                 r"algorithm 'grpo' uses policy_loss='ppo', not 'sapo'$"):
        _compile("arith_grpo", "train.loss.policy_loss=sapo")


def test_executors_read_the_loss_config_and_the_algorithm_from_the_plan():
    import torch

    from areal_flow.algorithms.base import BaseAlgorithm
    from runtime.executors.advantage import AdvantageExecutor
    from runtime.executors.train_settings import TrainSettings

    class NeverRegistered(BaseAlgorithm):
        """Known to this process only through the plan's encoded copy."""

    loss = _loss(clip_eps_high=0.25, use_decoupled_loss=True, kl_coef=0.5, kl_in_reward=True)
    step = NS(name="train_step", op="train_step", trains=True, model="policy", inputs={"advantages": ["advantage", "advantages"]},
              attrs={"algorithm": "test_never_registered", "loss": loss, "lr": 0.1, "weight_decay": 0.0,
                     "max_grad_norm": 1.0}, micro_batches=1, activation_checkpointing=False)
    plan = NS(nodes=[step], models={"policy": {"head": "lm"}}, algorithms={"test_never_registered":
                                                                           encode_value(NeverRegistered)})
    ctx = NS(plan=plan, folders={"policy": "unused"}, seed=0, pad_id=0,
             generator=lambda: NS(attrs={"temperature": 1.0}))
    model = torch.nn.Linear(1, 1)
    algorithm = TrainSettings.from_node(step, ctx).build_algorithm(model, torch.optim.SGD(model.parameters(), 0.1))
    assert type(algorithm).__qualname__.endswith("NeverRegistered") and algorithm.loss_cfg == LossConfig(**loss)
    adv = NS(name="advantage", model=None, attrs={"estimator": "grpo", "kl_coef": 0.0}, where=lambda: "advantage")
    assert AdvantageExecutor(adv, ctx).loss_cfg == LossConfig(**loss)  # its consumer's, from the plan


# ---------------------------------------------------------------- user code by value
PROBE = """
import json, sys
from compiler.plan import Plan
from runtime.plan_ops import register_plan_ops
import torch
from areal_flow.algorithms.advantages import compute_advantages
from areal_flow.algorithms.lookup import get_algorithm

plan = Plan.from_json(open(sys.argv[1]).read())
register_plan_ops(plan)
cls = get_algorithm("my_grpo")
out = compute_advantages("centered", rewards=torch.tensor([3.0, 1.0, 2.0]), group_ids=torch.tensor([0, 0, 1]),
                         loss_mask=torch.ones(3, 1))
print(json.dumps([cls.default_estimator, cls.loss_defaults, out.advantages.flatten().tolist(),
                  any(m.startswith("areal_flow_graph") for m in sys.modules)]))
"""


def test_user_algorithm_and_estimator_travel_in_the_plan(tmp_path):
    graph = write_user_graph(tmp_path)
    plan_path = tmp_path / "plan.json"
    subprocess.run([*CLI, "compile", str(graph), "--config", "graphs/arith_grpo.yaml", *TINY, "--plan", "-o",
                    str(plan_path)], cwd=REPO, check=True, capture_output=True)
    plan = Plan.from_json(plan_path.read_text())
    assert (list(plan.algorithms), list(plan.estimators)) == (["my_grpo"], ["centered"])
    assert plan.node("advantage").attrs["estimator"] == "centered"  # the algorithm's default, decided while tracing
    assert plan.node("train_step").attrs["loss"] == _loss(clip_eps_high=0.3, use_decoupled_loss=True)
    probe = subprocess.run([sys.executable, "-c", PROBE, str(plan_path)], cwd=REPO, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-2000:]
    # group 0: rewards 3, 1 (mean 2) -> +1, -1; group 1 alone -> 0; the graph file was never imported
    assert json.loads(probe.stdout.splitlines()[-1]) == ["centered", {"clip_eps_high": 0.3}, [1.0, -1.0, 0.0], False]


@pytest.mark.slow
def test_user_algorithm_runs_from_its_graph_file_and_from_its_plan(tmp_path, warm_cache):
    graph = write_user_graph(tmp_path)
    common = ["--config", "graphs/arith_grpo.yaml", "train.steps=2", *TINY[1:], f"out_dir={tmp_path}"]
    done = subprocess.run([*CLI, "run", str(graph), *common, "name=from_graph"], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    check_user_run(tmp_path / "from_graph", steps=2)
    plan_path = tmp_path / "plan.json"
    subprocess.run([*CLI, "compile", str(graph), *common, "name=from_plan", "--plan", "-o", str(plan_path)], cwd=REPO,
                   check=True, capture_output=True)
    done = subprocess.run([*CLI, "run", "--plan", str(plan_path)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    check_user_run(tmp_path / "from_plan", steps=2)


# ------------------------------------------------------------- a hand-edited plan
@pytest.mark.slow
def test_hand_edited_b_and_weight_route_are_what_runs(tmp_path, warm_cache):
    """Compile (B = 2, k = 2, 3 steps), then in plan.json set B = 1 and delete the weight
    route (allowed: k >= steps - 1); ``run --plan`` trains 3 groups, all from version 0."""
    plan_path = tmp_path / "plan.json"
    subprocess.run([*CLI, "compile", "graphs/arith_grpo.py", *TINY, f"out_dir={tmp_path}", "--plan", "-o",
                    str(plan_path)], cwd=REPO, check=True, capture_output=True)
    data = json.loads(plan_path.read_text())
    assert [(r["src"], r["dst"]) for r in data["routes"]] == [("train_step", "generate")]
    data["routes"] = []
    edge = next(e for e in data["edges"] if e["dst"] == "train_step")
    assert (edge["batch_groups"], edge["max_staleness"]) == (2, 2)
    edge["batch_groups"] = 1
    plan_path.write_text(json.dumps(data))
    done = subprocess.run([*CLI, "run", "--plan", str(plan_path)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    records = trained_records(tmp_path / "arith_grpo")
    assert sorted(r["group_id"] for r in records) == [0] * 4 + [1] * 4 + [2] * 4  # B = 1: one group per step
    assert [r["step"] for r in records] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(set(r["versions"]) == {0} for r in records)  # no route: every token from version 0
    assert [r["staleness"] for r in records] == [r["step"] for r in records]
    replica = json.loads((tmp_path / "arith_grpo" / "summary.json").read_text())["workers"]["generate/0"]
    assert (replica["weight_updates"], replica["final_version"]) == (0, 0)  # the trainer published to nobody


def test_the_weight_sync_is_sized_in_the_dtype_the_weights_travel_in():
    """The route's bytes are n_params x the bytes of the sync node's ``weights_dtype`` where it
    names a dtype (an fp32 engine gets fp32: 4 bytes, whatever ``compile.dtype`` says), else
    ``compile.dtype``'s (``engine``: the dtype is known only once the engine starts)."""
    from compiler.models import resolve_model

    fp32 = _compile("arith_grpo", "compile.dtype=bf16")
    params = resolve_model(fp32.models["policy"]["spec"]).n_params  # tiny-arith
    assert [node.attrs["weights_dtype"] for node in fp32.nodes if node.op == "sync_weights"] == ["float32"]
    assert [r.bytes for r in fp32.routes] == [4 * params]
    spec = resolve_model("tiny-arith")
    kept = spec.vocab * spec.hidden + spec.vector_params  # the LM head and the vectors stay fp32 (weight_wire)
    half = _compile("arith_grpo", "compile.dtype=fp32", "gen.dtype=bfloat16")
    assert [r.bytes for r in half.routes] == [2 * (params - kept) + 4 * kept]
    engine = _compile("arith_grpo", "compile.dtype=fp16", "gen.dtype=auto")
    assert [node.attrs["weights_dtype"] for node in engine.nodes if node.op == "sync_weights"] == ["engine"]
    assert [r.bytes for r in engine.routes] == [2 * (params - kept) + 4 * kept]  # compile.dtype=fp16's 2 bytes
