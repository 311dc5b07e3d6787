"""The algorithm graphs in ``graphs/``: they trace, compile and run; plus the runtime
support they need (critic, reference model, DAPO's reward-side filter, config ``base``).

The run tests use tiny settings and one warm start shared by every run (cached under
``$AREAL_FLOW_CACHE``; the suite sets ``<repo>/.cache/areal_flow``, tests/conftest.py), so SFT runs once.
"""

from __future__ import annotations

import glob
import json
import math
from pathlib import Path

import pytest
import torch

from areal_flow import Model, flow, ops
from areal_flow.blocks import sample_groups, train_policy
from areal_flow.cli import default_config_path, load_flow
from areal_flow.config import ConfigError
from areal_flow.config_load import load_config
from areal_flow.graph import GraphError
from areal_flow.models.critic import ValueModel
from areal_flow.models.tiny import build_model
from areal_flow.models.tokenizer import build_char_tokenizer
from types import SimpleNamespace

from areal_flow.ops.filter import DynamicSamplingError, FilterExecutor
from areal_flow.ops.reward import RewardExecutor
from compiler.program import compile_program
from areal_flow.types import Trajectory
from runtime.topology import build_topology

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = ("ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "sapo", "m2po", "lite_ppo")
ALGORITHM_GRAPHS = [REPO / "graphs" / f"arith_{algo}.py" for algo in ALGORITHMS]  # run on the tiny task
GRAPHS = sorted(REPO.glob("graphs/*.py"))  # every graph compiles
TINY = ["train.steps=2", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false"]


def _graph(path: Path, overrides: tuple[str, ...] = ()):
    fl = load_flow(path)
    cfg = load_config(default_config_path(fl, None), list(overrides))
    return fl(cfg), cfg


def _traj(group: int, j: int, reward_text: str, answer: str, n_tokens: int = 2) -> Trajectory:
    return Trajectory(f"{group}:{j}", group, [1], [5] * n_tokens, [-0.1] * n_tokens, [0] * n_tokens, "stop",
                      output_text=reward_text, meta={"answer": answer})


# --------------------------------------------------------------------------- graphs
def test_one_graph_per_algorithm():
    for path in ALGORITHM_GRAPHS:
        assert path.is_file() and path.with_suffix(".yaml").is_file(), path


@pytest.mark.parametrize("path", GRAPHS, ids=lambda p: p.stem)
def test_every_graph_compiles(path):
    graph, cfg = _graph(path)
    plan = compile_program(graph, cfg)
    assert plan.to_json()  # serialisable
    build_topology(plan)  # the runtime accepts its shape
    roles = {n.name: n.role for n in plan.nodes}
    generator = "rollout" if "agent" in path.stem or path.stem == "arith_python_tool" else "generate"
    assert roles[generator] == "generation" and roles["train_step"] == "training"
    if path.stem == "arith_ppo":  # the critic is read (GAE values) and trained
        assert roles["critic_step"] == "training" and roles["advantage"] == "inference"
    if path.stem == "arith_reinforce_pp":  # reference log-probs: a forward pass
        assert roles["advantage"] == "inference"



def _prompt_graphs():
    """Every graph whose generator reads dataset prompts; the SmolLM2 ones need its GGUF."""
    from markers import needs_smollm2

    return [pytest.param(p, marks=[needs_smollm2] if p.stem in ("arith_chat_grpo", "gsm8k_grpo") else [], id=p.stem)
            for p in GRAPHS if not ("agent" in p.stem or p.stem == "arith_python_tool")]


@pytest.mark.parametrize("path", _prompt_graphs())
def test_every_graphs_prompts_fit_its_plans_prompt_budget(path):
    """``compile.max_prompt_len`` sized the plan (memory, time); the yaml beside each graph sets it
    to cover its task's prompts as its generate node encodes them (300 held-out problems)."""
    from areal_flow.models.hf import load_model
    from areal_flow.models.tiny import build_in_code
    from areal_flow.ops.generate import encode_prompt
    from areal_flow.tasks.catalog import build_task

    graph, cfg = _graph(path)
    plan = compile_program(graph, cfg)
    source = next(n for n in plan.nodes if n.grain == "source")
    gen = next(n for n in plan.nodes if n.op == "generate")
    built = build_in_code(cfg.model.path)
    tokenizer = built[1] if built else load_model(cfg.model.path)[1]
    lengths = [len(encode_prompt(tokenizer, p["prompt"], gen.attrs.get("chat_template")))
               for p in build_task(source.attrs, 0).test_set(300)]
    assert max(lengths) <= plan.workload["prompt_len"] == cfg.compile.max_prompt_len, (path.name, max(lengths))

def test_ppo_graph_trains_policy_and_critic_and_reads_the_critic():
    graph, cfg = _graph(REPO / "graphs/arith_ppo.py")
    plan = compile_program(graph, cfg)
    trainer = next(g for g in build_topology(plan).groups.values() if g.batch_nodes)  # one worker group runs all three
    assert trainer.batch_nodes == ["advantage", "train_step", "critic_step"]
    assert [plan.node(n).model for n in trainer.batch_nodes] == ["critic", "policy", "critic"]
    assert plan.models["critic"]["head"] == "value" and plan.node("advantage").attrs["estimator"] == "gae"


def test_reinforce_pp_graph_reads_a_frozen_reference():
    graph, _ = _graph(REPO / "graphs/arith_reinforce_pp.py")
    assert graph.models["ref"].trainable is False
    assert graph.nodes["advantage"].attrs["model_role"] == "ref"


def test_graph_algorithm_must_match_config():
    with pytest.raises(GraphError, match="trains with algorithm 'gspo' but train.algorithm='grpo'"):
        _graph(REPO / "graphs/arith_gspo.py", ("train.algorithm=grpo",))


def test_advantage_reads_one_model_and_ref_must_be_frozen():
    @flow
    def two_models(cfg):
        policy = Model("policy", "tiny-arith")
        rollout = sample_groups(policy, cfg)
        ops.advantage(rollout, ops.reward(rollout), critic=Model("c", "tiny-arith"),
                      ref=Model("r", "tiny-arith", trainable=False))

    @flow
    def trainable_ref(cfg):
        policy = Model("policy", "tiny-arith")
        rollout = sample_groups(policy, cfg)
        ops.advantage(rollout, ops.reward(rollout), ref=Model("r", "tiny-arith"))

    with pytest.raises(GraphError, match="pass critic= or ref=, not both"):
        two_models(load_config(None))
    with pytest.raises(GraphError, match="must be declared Model\\(..., trainable=False\\)"):
        trainable_ref(load_config(None))


# --------------------------------------------------------------------- yaml base
def test_yaml_base_merges_and_reports_the_right_file(tmp_path):
    (tmp_path / "a.yaml").write_text("seed: 3\ntrain:\n  lr: 0.5\n  steps: 7\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\ntrain:\n  steps: 9\n")
    cfg = load_config(tmp_path / "b.yaml", ["train.lr=0.25"])
    assert (cfg.seed, cfg.train.steps, cfg.train.lr) == (3, 9, 0.25)  # base, file over base, override over file
    (tmp_path / "a.yaml").write_text("seed: 3\ntrain:\n  stepz: 7\n")
    with pytest.raises(ConfigError, match=r"a.yaml:3\)"):  # the typo is on line 3 of the base
        load_config(tmp_path / "b.yaml")
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    with pytest.raises(ConfigError, match="config base cycle"):
        load_config(tmp_path / "b.yaml")


# ------------------------------------------------------------ DAPO reward filter
def _half_answers_constant(output_text: str, answer: str) -> float:
    """Even answers score 1.0 whatever the output (an all-equal group); odd answers score
    the parity of the output's length (groups with mixed lengths are informative)."""
    return 1.0 if int(answer) % 2 == 0 else float(len(output_text) % 2)


def _reward_node(**attrs):
    return SimpleNamespace(name="reward", model=None, attrs={"fn": _half_answers_constant, "overlong": None, **attrs})


def test_dynamic_sampling_drops_all_equal_groups_and_bounds_attempts():
    reward = RewardExecutor(_reward_node(), SimpleNamespace(pad_id=0))
    keep = FilterExecutor(SimpleNamespace(name="filter", attrs={"keep": "informative", "max_attempts": 2}), None)
    informative = [_traj(0, 0, "7", "7"), _traj(0, 1, "78", "7")]  # odd answer, lengths 1, 2: rewards 1, 0
    rewards = reward.run({"rollouts": informative}, {})["rewards"]
    assert list(rewards) == [1.0, 0.0]
    assert keep.run({"rollouts": informative, "rewards": rewards}, {"index": 0, "attempt": 1}) is not None
    constant = [_traj(1, 0, "x", "4"), _traj(1, 1, "y", "4")]  # even answer: rewards 1, 1
    rewards = reward.run({"rollouts": constant}, {})["rewards"]
    assert keep.run({"rollouts": constant, "rewards": rewards}, {"index": 1, "attempt": 1}) is None  # dropped
    with pytest.raises(DynamicSamplingError, match="batch slot 1 drew 2 prompt groups in a row .* max_attempts"):
        keep.run({"rollouts": constant, "rewards": rewards}, {"index": 1, "attempt": 2})


def test_overlong_shaping_in_the_reward_node():
    reward = RewardExecutor(_reward_node(overlong=[8, 3]), SimpleNamespace(pad_id=0))
    group = [_traj(0, j, "z", "2", n_tokens=n) for j, n in enumerate((5, 6, 7, 8))]  # even answer: reward 1.0
    rewards = reward.run({"rollouts": group}, {})["rewards"]
    # L_max - L_cache = 5: 5 tokens -> 0; 6 -> (5-6)/3; 7 -> (5-7)/3; 8 -> (5-8)/3 = -1; added to reward 1.0
    assert list(rewards) == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])


def test_filter_node_rejects_bad_arguments():
    @flow
    def bad(cfg):
        rollout = sample_groups(Model("policy", "tiny-arith"), cfg)
        ops.filter(rollout, ops.reward(rollout, fn="arithmetic"), keep="informative", max_attempts=0)

    with pytest.raises(GraphError, match="max_attempts=0"):
        bad(load_config(None))


# ------------------------------------------------------------------------ critic
def test_value_model_layout_and_round_trip(tmp_path):
    tok = build_char_tokenizer()
    build_model("tiny-s", len(tok)).save_pretrained(tmp_path / "policy")
    critic = ValueModel.from_policy(tmp_path / "policy", seed=3)
    ids = torch.tensor([[1, 5, 6, 7, 2]])
    attn = torch.ones_like(ids)
    values = critic(input_ids=ids, attention_mask=attn)
    hidden = critic.backbone(input_ids=ids, attention_mask=attn).last_hidden_state
    head = critic.value_head(hidden).squeeze(-1)
    assert values.shape == (1, 5) and values[0, 0] == 0  # nothing precedes token 0
    assert torch.allclose(values[0, 1:], head[0, :-1])  # V before token t = head(h_{t-1})
    critic.save(tmp_path / "critic")
    assert torch.equal(ValueModel.load(tmp_path / "critic")(input_ids=ids, attention_mask=attn), values)


def test_a_critic_loads_and_saves_without_transformers_progress_bars(tmp_path, capsys):
    """Inside a run the critic's load and checkpoint must not draw transformers' "Loading weights"
    / "Writing model shards" bars within the run's own; the switch is left as it was."""
    from transformers.utils import logging as hf_logging

    build_model("tiny-s", len(build_char_tokenizer())).save_pretrained(tmp_path / "policy")
    hf_logging.enable_progress_bar()
    capsys.readouterr()
    ValueModel.from_policy(tmp_path / "policy").save(tmp_path / "critic")
    ValueModel.load(tmp_path / "critic")
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err, err
    assert hf_logging.is_progress_bar_enabled()  # on again after each call
    build_model("tiny-s", len(build_char_tokenizer())).save_pretrained(tmp_path / "plain")
    assert "Writing model shards" in capsys.readouterr().err  # the bar this test would see


# -------------------------------------------------------------------- run tests
def _scalars(out: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(out / "events*"))[-1])
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _groups(out: Path) -> dict[int, list[dict]]:
    groups: dict[int, list[dict]] = {}
    for line in (out / "trajectories" / "trajectories.jsonl").read_text().splitlines():
        record = json.loads(line)
        groups.setdefault(record["group_id"], []).append(record)
    return groups


@pytest.mark.slow
@pytest.mark.parametrize("path", ALGORITHM_GRAPHS, ids=lambda p: p.stem)
def test_graph_runs_a_few_steps(path, tmp_path, warm_cache):
    from areal_flow.cli import run_main

    fl = load_flow(path)
    assert run_main(fl, [*TINY, f"out_dir={tmp_path}"]) == 0  # what `python graphs/<x>.py ...` runs
    out = tmp_path / fl.name
    groups = _groups(out)
    assert sum(len(g) for g in groups.values()) == 2 * 2 * 4  # steps x groups x samples
    scalars = _scalars(out)
    for tag in ("train/loss", "train/grad_norm", "rl/reward"):
        assert len(scalars[tag]) == 2 and all(math.isfinite(v) for v in scalars[tag]), tag
    if fl.name == "arith_ppo":  # the critic trained: its backbone left the policy's initial weights
        initial = ValueModel.from_policy(json.loads((out / "summary.json").read_text())["initial_model"]).backbone
        trained = ValueModel.load(out / "critic").backbone
        assert all(math.isfinite(v) for v in scalars["train/value_loss"])
        assert initial.state_dict().keys() == trained.state_dict().keys()
        assert any(not torch.equal(a, trained.state_dict()[k]) for k, a in initial.state_dict().items())
    if fl.name == "arith_dapo":  # every trained group survived the filter: its rewards differ
        assert all(len({t["reward"] for t in g}) > 1 for g in groups.values())
    if fl.name == "arith_reinforce_pp":
        assert all(math.isfinite(v) for v in scalars["train/kl_ref_in_reward"])  # k1 may be negative


@flow
def half_constant_dapo(cfg):
    """DAPO's graph with a reward that makes every even-answer group all-equal."""
    policy = Model("policy", cfg.model)
    rollout = sample_groups(policy, cfg)
    reward = ops.reward(rollout, fn=_half_answers_constant)
    kept = ops.filter(rollout, reward, keep="informative", max_attempts=cfg.reward.max_attempts)
    adv = ops.advantage(kept, reward, estimator="grpo")
    return train_policy(policy, adv, rollout, cfg, algorithm="grpo")


@pytest.mark.slow
def test_runtime_replaces_dropped_groups_under_the_same_slot(tmp_path, warm_cache):
    from areal_flow.cli.run import run_experiment

    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, f"out_dir={tmp_path}", "reward.max_attempts=16"])
    summary = run_experiment(half_constant_dapo(cfg), cfg, show_progress=False)
    groups = _groups(tmp_path / cfg.name)
    assert summary["workers"]["generate/0"]["dropped"] >= 1 and summary["workers"]["router"]["resampled"] >= 1
    assert sorted(groups) == [0, 1, 2, 3]  # admission indices stay 0..3: replacements reuse the slot
    assert all(int(g[0]["meta"]["answer"]) % 2 == 1 for g in groups.values())  # no all-equal group was trained
    assert any(g[0]["meta"]["attempt"] > 1 for g in groups.values())


def test_the_text_game_config_runs_the_agent_graph_on_guess_number():
    fl = load_flow(REPO / "graphs/agent_support.py")
    cfg = load_config(REPO / "graphs/agent_guess_number.yaml", [])
    plan = compile_program(fl(cfg), cfg)
    rollout = plan.node("rollout")
    assert (rollout.attrs["env"], rollout.attrs["max_turns"], rollout.attrs["max_new_tokens"]) == ("guess_number", 8, 4)
    assert build_topology(plan).generation.nodes == ["rollout"]
