"""Multi-turn rollouts: turn credit by hand, the episode's token layout, the episode loop
(mixed versions across a weight update, a raising and a hanging env end only their
episode), and the issue's env template run verbatim from a graph file."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch

from areal_flow.algorithms.returns import multi_turn
from areal_flow.envs import BaseEnv, env_class
from areal_flow.envs.episode import Episode
from areal_flow.models.tokenizer import build_char_tokenizer
from areal_flow.batching import collate
from runtime.engines.generation import GenerationResult, SamplingParams
from runtime.evaluate import play_episodes
from runtime.executors.episode_runner import EpisodeRunner
from runs import REPO, cli_run, records

TOK = build_char_tokenizer()


def cid(ch: str) -> int:
    """Character id by hand: 4 special tokens, then ``0-9 + - * / = ( ) . , space a-z``."""
    return 4 + "0123456789+-*/=()., abcdefghijklmnopqrstuvwxyz".index(ch)


# one episode, response part: turn 0 (2 policy tokens), 2 observation tokens, turn 1 (1 policy
# token), 1 observation token, turn 2 (2 policy tokens); turn rewards -0.1, -0.1, 1.0
MASK = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1]], dtype=torch.float32)
TURNS = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2]])
R = torch.tensor([[-0.1, -0.1, 1.0]])


def test_turn_returns_by_hand_with_observations_between_turns():
    # G_2 = 1; G_1 = -0.1 + 0.9 * 1 = 0.8; G_0 = -0.1 + 0.9 * 0.8 = 0.62
    out = multi_turn(R, TURNS, MASK, gamma=0.9)
    assert out.advantages[0].tolist() == pytest.approx([0.62, 0.62, 0, 0, 0.8, 0, 1.0, 1.0])
    g0 = multi_turn(R, TURNS, MASK, gamma=0.0).advantages[0].tolist()  # gamma 0: each turn its own reward
    assert g0 == pytest.approx([-0.1, -0.1, 0, 0, -0.1, 0, 1.0, 1.0])
    g1 = multi_turn(R, TURNS, MASK, gamma=1.0).advantages[0].tolist()  # gamma 1: the sum of what follows
    assert g1 == pytest.approx([0.8, 0.8, 0, 0, 0.9, 0, 1.0, 1.0])


def test_token_returns_by_hand_skip_observation_tokens():
    # policy tokens p0..p4; rewards on the last token of each turn: p1 -0.1, p2 -0.1, p4 1.0
    # G(p4) = 1; G(p3) = 0.9; G(p2) = -0.1 + 0.81 = 0.71; G(p1) = -0.1 + 0.639 = 0.539; G(p0) = 0.4851
    out = multi_turn(R, TURNS, MASK, gamma=0.9, mode="token")
    assert out.advantages[0].tolist() == pytest.approx([0.4851, 0.539, 0, 0, 0.71, 0, 0.9, 1.0])


def test_group_baseline_over_whole_episodes():
    # episode A as above (G_0 = 0.62), episode B one turn rewarded 1 (G_0 = 1); baseline 0.81
    mask = torch.cat([MASK, torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)])
    turns = torch.cat([TURNS, torch.zeros(1, 8, dtype=torch.long)])
    rewards = torch.cat([R, torch.tensor([[1.0, 0.0, 0.0]])])
    out = multi_turn(rewards, turns, mask, gamma=0.9, group_ids=torch.tensor([7, 7]), baseline="group")
    assert out.advantages[0].tolist() == pytest.approx([-0.19, -0.19, 0, 0, -0.01, 0, 0.19, 0.19])
    assert out.advantages[1, 0].item() == pytest.approx(0.19)
    assert out.returns[0, 0].item() == pytest.approx(0.62)  # value targets carry no baseline


def test_episode_layout_masks_observation_tokens():
    ep = Episode(TOK, chat=False)
    ep.observe("ab")
    ep.act([cid("7"), TOK.eos_token_id], [-0.5, -0.25], [3, 3], "7", "stop")
    ep.reward(-0.1)
    ep.observe("c")
    ep.act([cid("8"), TOK.eos_token_id], [-1.0, -2.0], [4, 4], "8", "stop")
    ep.reward(1.0)
    t = ep.to_trajectory("0:0", 0, gamma=0.5, meta={})
    assert t.prompt_ids == [1, cid("a"), cid("b")]
    # the later observation "c" ends with EOS (layout 2): the token before a policy turn is EOS
    assert t.output_ids == [cid("7"), 2, cid("c"), 2, cid("8"), 2]
    assert t.loss_mask == [1, 1, 0, 0, 1, 1]
    assert t.versions == [3, 3, -1, -1, 4, 4] and t.start_version == 3
    assert t.behavior_logprobs == [-0.5, -0.25, 0.0, 0.0, -1.0, -2.0]
    assert t.turn_ids == [0, 0, 0, 0, 1, 1]
    assert t.reward == pytest.approx(-0.1 + 0.5 * 1.0)
    batch = collate([t], pad_id=0)
    assert batch["loss_mask"][0].tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert batch["turn_rewards"][0].tolist() == pytest.approx([-0.1, 1.0])
    assert batch["versions"][0].tolist() == [-1, -1, -1, 3, 3, -1, -1, 4, 4]


class FakeEngine:
    """Answers every request at once with ``reply`` + EOS, log-prob -0.5 per token, at ``version``."""

    def __init__(self, reply: str = "7") -> None:
        self.version, self.pending, self.reply = 0, [], reply

    def submit(self, request) -> None:
        self.pending.append(request)

    def has_work(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[GenerationResult]:
        ids = [cid(c) for c in self.reply] + [TOK.eos_token_id]
        out = [GenerationResult(r.request_id, r.prompt_ids, ids, [-0.5] * len(ids), [self.version] * len(ids), "stop",
                                self.reply, r.meta) for r in self.pending]
        self.pending = []
        return out

    def update_weights(self, state_dict, version: int) -> None:
        self.version = version


class CountEnv(BaseEnv):
    """Three turns: reward 1 when the policy says the row's answer, done after turn 3;
    ``row["mode"]`` = "raise" raises in step, "hang" sleeps 5 s in step."""

    def reset(self):
        self.turn = 0
        return "go"

    def step(self, action):
        if self.config.get("mode") == "raise":
            raise RuntimeError("env broke")
        if self.config.get("mode") == "hang":
            time.sleep(5)
        self.turn += 1
        return "again", float(action == self.config["answer"]), self.turn == 3, {"success": 1.0}


ATTRS = dict(env="count", env_class=CountEnv, max_turns=3, gamma=1.0, n_samples=2, step_timeout_s=0.3,
             temperature=1.0, top_p=1.0, max_new_tokens=4, chat_template=False)


def _drain(runner: EpisodeRunner) -> dict:
    done, started = {}, time.monotonic()
    while runner.has_work():
        assert time.monotonic() - started < 10, "episodes did not finish"
        done.update((index, trajs) for index, _, trajs in runner.step())
    return done


def _runner(engine, **attrs) -> EpisodeRunner:
    return EpisodeRunner(engine, TOK, {**ATTRS, **attrs}, SamplingParams(max_new_tokens=4), max_context=256)


def test_a_weight_update_between_turns_gives_mixed_versions():
    engine = FakeEngine()
    step = engine.step

    def step_then_update():  # a new policy version lands after every engine step
        out = step()
        runner.update_weights(None, engine.version + 1)
        return out

    engine.step = step_then_update
    runner = _runner(engine, n_samples=1)
    runner.submit(0, 1, {"id": 0, "answer": "7"})
    done = _drain(runner)
    (t,) = done[0]
    policy_versions = [v for v, m in zip(t.versions, t.loss_mask) if m]
    assert len(set(policy_versions)) == 3  # each turn sampled under a newer version
    assert all(v == -1 for v, m in zip(t.versions, t.loss_mask) if not m)
    assert t.turn_rewards == [1.0, 1.0, 1.0] and t.reward == 3.0


def test_raising_and_hanging_envs_end_only_their_episode():
    runner = _runner(FakeEngine())
    runner.submit(0, 1, {"id": 0, "answer": "7"})
    runner.submit(1, 1, {"id": 1, "answer": "7", "mode": "raise"})
    runner.submit(2, 1, {"id": 2, "answer": "7", "mode": "hang"})
    started = time.monotonic()
    done = _drain(runner)
    assert time.monotonic() - started < 3  # the hanging env did not hold its group for 5 s x 3 turns
    assert len(done[0]) == 2 and len(done[1]) == 0 and len(done[2]) == 0
    assert runner.counts == {"episodes": 6, "episodes_failed": 4, "env_timeouts": 2, "tool_call_errors": 0,
                             "empty_episodes": 0}


def test_play_episodes_with_the_fake_engine_scores_by_the_env():
    trajs = play_episodes(FakeEngine(reply="5"), TOK, {**ATTRS, "n_samples": 1}, [{"id": 0, "answer": "5"},
                                                                                   {"id": 1, "answer": "6"}], 256)
    assert [t.reward for t in trajs] == [3.0, 0.0]



def test_env_config_reaches_the_env_and_the_row_wins():
    """``ops.rollout(env_config=...)`` (the yaml's ``env.config``) is merged under each row: the
    support desk's turn cost comes from it unless the row sets its own. Reply "x" is a plain
    text turn (-turn_cost, the episode goes on) for 2 turns: G_0 = -c - c = -2c at gamma 1."""
    attrs = {**ATTRS, "env": "support_desk", "env_class": env_class("support_desk"), "max_turns": 2,
             "n_samples": 1, "env_config": {"turn_cost": 0.25}}
    rows = [{"id": 0, "intent": "refund", "order": 4821},
            {"id": 1, "intent": "refund", "order": 4821, "turn_cost": 0.5}]
    trajs = play_episodes(FakeEngine(reply="x"), TOK, attrs, rows, 256)
    assert [t.turn_rewards for t in trajs] == [[-0.25, -0.25], [-0.5, -0.5]]
    assert [t.reward for t in trajs] == pytest.approx([-0.5, -1.0])

TEMPLATE_GRAPH = '''
from areal_flow import Model, flow, ops
from areal_flow.envs import BaseEnv, register_env


@register_env("my_env")
class MyCustomEnv(BaseEnv):
    def __init__(self, config):
        super().__init__(config)
    def reset(self):
        self.turns = 0
        return self.config["prompt"]
    def step(self, action):
        self.turns += 1
        observation, reward = "again=", float(action == self.config["answer"])
        done, info = reward > 0 or self.turns == 2, {"success": reward}
        return observation, reward, done, info


@flow
def my_env_grpo(cfg):
    policy = Model("policy", cfg.model)
    episodes = ops.rollout(policy, ops.dataset(cfg.dataset), env="my_env", max_turns=2, gamma=0.9,
                           n_samples=cfg.gen.n_samples, max_new_tokens=cfg.gen.max_new_tokens)
    adv = ops.advantage(episodes, estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=episodes)
    return stats
'''


@pytest.mark.slow
def test_the_env_template_runs_verbatim_from_a_graph_file(tmp_path, warm_cache):
    graph = tmp_path / "my_env_grpo.py"
    graph.write_text(TEMPLATE_GRAPH)
    (tmp_path / "my_env_grpo.yaml").write_text((REPO / "graphs/arith_grpo.yaml").read_text())
    args = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.n_test=8",
            f"out_dir={tmp_path}", "name=template"]
    cli_run(graph, *args)
    out = tmp_path / "template"
    trained = records(out)
    assert len(trained) == 3 * 2 * 4 == len({r["sample_id"] for r in trained})
    for r in trained:
        policy = [v for v, m in zip(r["versions"], r["loss_mask"]) if m]
        assert r["step"] - min(policy) <= 2  # the staleness bound over policy tokens
        assert 1 <= len(r["turn_rewards"]) <= 2
        # the episode's reward is its discounted return, by hand from its turn rewards
        assert r["reward"] == pytest.approx(sum(x * 0.9**k for k, x in enumerate(r["turn_rewards"])))
        if len(r["turn_rewards"]) == 2:  # the observation "again=" sits between the turns, masked
            assert 0 in r["loss_mask"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes_before"]["failed"] == summary["episodes_after"]["failed"] == 0
    assert 1 <= summary["episodes_after"]["turns"] <= 2 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert summary["workers"]["rollout/0"]["episodes"] == 3 * 2 * 4
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(out.glob("events*"))))
    events.Reload()
    for tag in ("episode/return", "episode/turns", "episode/tool_call_error_rate", "env/failures", "env/success"):
        assert len(events.Scalars(tag)) == 3, tag
    assert all(1 <= e.value <= 2 for e in events.Scalars("episode/turns"))


@pytest.mark.slow
def test_a_run_whose_env_always_fails_stops_with_one_line(tmp_path, warm_cache):
    """Window 8, fraction 0.5: the 5th failed episode (> 4) stops the run in seconds, naming the
    node and the env, rather than the trainer's 600 s timeout."""
    import subprocess
    import sys

    graph = tmp_path / "broken_env.py"
    graph.write_text(TEMPLATE_GRAPH.replace("        self.turns += 1\n", "        raise RuntimeError('broken env')\n"))
    (tmp_path / "broken_env.yaml").write_text((REPO / "graphs/arith_grpo.yaml").read_text())
    args = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false",
            "reward.failure_window=8", f"out_dir={tmp_path}", "name=broken"]
    proc = subprocess.run([sys.executable, "-m", "areal_flow.cli", "run", str(graph), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    (line,) = [x for x in proc.stderr.splitlines() if "FailureFractionError" in x]
    assert "rollout node 'rollout' (env 'my_env'): 5 of the last 5 samples failed" in line
    assert "RuntimeError: broken env" in line


def multi_turn_advantages(name: str, attrs: dict, gamma: float):
    """The advantage executor's output for one 3-turn episode (turn rewards -0.1, -0.1, 1.0,
    observations "ab" and "c" between turns) with node attributes ``attrs``; the rollout's
    ``gamma`` is recorded on the trajectory. Returns (advantages on policy tokens, their sum
    of absolute values on the other tokens)."""
    from types import SimpleNamespace

    from runtime.executors.advantage import AdvantageExecutor

    ep = Episode(TOK, chat=False)
    ep.observe("go")
    for k, (r, obs) in enumerate(((-0.1, "ab"), (-0.1, "c"), (1.0, None))):
        ep.act([cid(str(k)), TOK.eos_token_id], [-0.5, -0.5], [0, 0], str(k), "stop")
        ep.reward(r)
        if obs:
            ep.observe(obs)
    node = SimpleNamespace(name=name, model=None, attrs=dict(attrs), where=lambda: "advantage")
    ctx = SimpleNamespace(plan=SimpleNamespace(nodes=[]), pad_id=0,
                          generator=lambda: SimpleNamespace(attrs={"temperature": 1.0}))
    out = AdvantageExecutor(node, ctx).run({"rollouts": [[ep.to_trajectory("0:0", 0, gamma, {})]]}, {})
    batch = out["advantages"].batch
    mask = batch["loss_mask"][0].bool()
    return batch["advantages"][0][mask].tolist(), batch["advantages"][0][~mask].abs().sum()


def test_the_advantage_node_credits_turns_with_the_multi_turn_estimator():
    """The node's wiring: collated turn rewards and turn ids reach ``multi_turn``; by hand as in
    ``test_turn_returns_by_hand_with_observations_between_turns`` (G = 0.62, 0.8, 1.0)."""
    adv, on_observations = multi_turn_advantages("advantage", {"estimator": "multi_turn", "gamma": 0.9}, 0.9)
    assert adv == pytest.approx([0.62, 0.62, 0.8, 0.8, 1.0, 1.0])
    assert on_observations == 0  # observation tokens: none


class AppendEnv(BaseEnv):
    """One turn; appends its row id to ``config["seen"]`` (a list from env_config) and bumps
    ``config["tags"]["n"]`` (a dict in the row); records what it saw in ``SEEN``."""

    SEEN: list = []

    def reset(self):
        self.config["seen"].append(self.config["id"])
        self.config["tags"]["n"] += 1
        AppendEnv.SEEN.append((list(self.config["seen"]), self.config["tags"]["n"]))
        return "go"

    def step(self, action):
        return "", 1.0, True, {}


def test_episodes_share_no_state_and_leave_rows_and_env_config_unchanged():
    """Four episodes (2 rows x n_samples 2): each starts from ``seen == []`` and ``n == 0``, so
    each sees exactly ``[its id]`` and ``n == 1``; the rows and env_config are as given."""
    AppendEnv.SEEN.clear()
    env_config = {"seen": []}
    rows = [{"id": 0, "tags": {"n": 0}}, {"id": 1, "tags": {"n": 0}}]
    runner = _runner(FakeEngine(), env="append", env_class=AppendEnv, max_turns=1, env_config=env_config)
    for i, row in enumerate(rows):
        runner.submit(i, 1, row)
    done = _drain(runner)
    assert [len(done[i]) for i in (0, 1)] == [2, 2]
    assert sorted(AppendEnv.SEEN) == [([0], 1), ([0], 1), ([1], 1), ([1], 1)]
    assert env_config == {"seen": []}
    assert rows == [{"id": 0, "tags": {"n": 0}}, {"id": 1, "tags": {"n": 0}}]


def test_an_env_that_always_fails_uses_up_the_failure_budget_with_one_line():
    """Window 4, fraction 0.5: more than 0.5 * 4 = 2 failures stop the run, i.e. the 3rd failed
    episode (groups of 2: the first episode of the second group), not an endless resample."""
    from areal_flow.rewards.pool import FailureFractionError

    runner = EpisodeRunner(FakeEngine(), TOK, {**ATTRS, "max_failure_fraction": 0.5, "failure_window": 4},
                           SamplingParams(max_new_tokens=4), max_context=256, name="play")
    for i in range(3):
        runner.submit(i, 1, {"id": i, "answer": "7", "mode": "raise"})
    with pytest.raises(FailureFractionError) as err:
        _drain(runner)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("rollout node 'play' (env 'count'): 3 of the last 3 samples failed")
    assert "RuntimeError: env broke" in line and "x3" in line


class FullPromptEnv(BaseEnv):
    """One turn rewarded 1.0; of every two episodes one opens with a 20-character observation
    (21 tokens with BOS: the context of 16 is full before any policy turn), the other with "go"."""

    calls = itertools.count()

    def reset(self):
        return "x" * 20 if next(FullPromptEnv.calls) % 2 == 0 else "go"

    def step(self, action):
        return "", 1.0, True, {}


def test_an_episode_with_no_policy_token_leaves_its_group():
    """Group of 2: the "go" episode plays its turn (G_0 = 1.0); the full-prompt one has no policy
    token and is left out, so the group is [1.0] (kept, it would be [1.0, 0.0]: baseline 0.5)."""
    runner = EpisodeRunner(FakeEngine(), TOK, {**ATTRS, "env": "full", "env_class": FullPromptEnv, "max_turns": 1},
                           SamplingParams(max_new_tokens=4), max_context=16)
    runner.submit(0, 1, {"id": 0})
    (traj,) = _drain(runner)[0]
    assert traj.reward == 1.0 and traj.prompt_ids == [1, cid("g"), cid("o")] and sum(traj.loss_mask) == 2
    assert runner.counts["empty_episodes"] == 1 and runner.counts["episodes_failed"] == 0
    assert runner.monitor.kinds == {"an episode with no policy token (its first observation fills max_context)": 1}

