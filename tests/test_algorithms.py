"""BaseAlgorithm.update_parameters on a tiny Qwen2, the registry, and DAPO helpers."""

import copy
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

from areal_flow.algorithms import registry
from areal_flow.algorithms.advantages import ESTIMATORS
from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.config import LOSS_AGG_MODES, LossConfig
from areal_flow.algorithms.dapo import fill_dynamic_batch, informative_groups, overlong_penalty
from areal_flow.algorithms.lookup import build_algorithm, get_algorithm, registered_algorithms
from areal_flow.algorithms.registry import register_algorithm
from areal_flow.models.logprobs import token_logprobs
from areal_flow.types import Trajectory

torch.set_num_threads(1)

PROMPT = [2, 3, 2, 2, 3]
RESPONSE = [3, 2, 1, 7, 0]  # row 3 fills the sequence to the end (truncated); row 4 is empty
ADV = [1.0, -1.0, 0.5, 2.0, 3.0]
T = 9
# On-policy (ratio 1) PPO loss is -A per token. Hand values over the 3+2+1+7 = 13 valid tokens:
#   sum_t A = 3*1 + 2*(-1) + 1*0.5 + 7*2 = 15.5, 4 non-empty sequences
#   token-mean               -15.5 / 13                      = -1.1923077
#   seq-mean-token-mean      -(1 - 1 + 0.5 + 2) / 4         = -0.625
#   seq-mean-token-sum       -15.5 / 4                       = -3.875
#   seq-mean-token-sum-norm  -15.5 / (4 * 7) (longest resp.) = -0.5535714
ON_POLICY_LOSS = {
    "token-mean": -15.5 / 13,
    "seq-mean-token-mean": -0.625,
    "seq-mean-token-sum": -3.875,
    "seq-mean-token-sum-norm": -15.5 / 28,
}


def _config():
    return Qwen2Config(
        vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(_config()).eval()


class TinyCritic(torch.nn.Module):
    """values[b, t] = V(state before token t), read from the hidden state at t - 1."""

    def __init__(self, seed=1):
        super().__init__()
        torch.manual_seed(seed)
        self.body = Qwen2Model(_config())
        self.head = torch.nn.Linear(32, 1)

    def forward(self, input_ids, attention_mask):
        pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        h = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).last_hidden_state
        return torch.nn.functional.pad(self.head(h).squeeze(-1)[:, :-1], (1, 0))


def make_batch(model, *, noise=0.0, shift=0.0, temperature=1.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    b = len(PROMPT)
    ids = torch.randint(1, 20, (b, T), generator=g)
    attn = torch.zeros(b, T, dtype=torch.long)
    loss_mask = torch.zeros(b, T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPT, RESPONSE)):
        attn[i, : p + r] = 1
        loss_mask[i, p : p + r] = 1
    ids = ids * attn
    with torch.no_grad():
        lp = token_logprobs(model, ids, attn, temperature=temperature)
    behavior = lp - shift + noise * torch.randn(b, T, generator=g)
    behavior = torch.where(loss_mask.bool(), behavior, torch.zeros(()))
    adv = torch.tensor(ADV)[:, None] * loss_mask
    return {
        "input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, "behavior_logprobs": behavior,
        "advantages": adv, "group_ids": torch.tensor([0, 0, 1, 1, 2]), "rewards": torch.tensor(ADV),
    }


def run(cfg, model, batch, *, mbs=5, cls=BaseAlgorithm, **kw):
    """Update a copy of ``model`` with SGD(lr=1): the parameter change is minus the
    (clipped) gradient. Returns (metrics, deltas, updated model)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    algo = cls(cfg, model, opt, micro_batch_size=mbs, max_grad_norm=1e6, **kw)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = algo.update_parameters(batch)
    deltas = [b - p.detach() for b, p in zip(before, model.parameters())]
    return metrics, deltas, model


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_on_policy_loss_by_hand_per_aggregation_mode(mode):
    model = tiny_model()
    m, deltas, _ = run(LossConfig(loss_agg_mode=mode), model, make_batch(model), mbs=2)
    assert m["loss"] == pytest.approx(ON_POLICY_LOSS[mode], abs=1e-5)
    assert m["policy_loss"] == pytest.approx(ON_POLICY_LOSS[mode], abs=1e-5)
    assert m["clip_frac"] == 0.0
    assert m["importance_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["kl_behavior_current"] == pytest.approx(0.0, abs=1e-6)
    assert m["behavior_logprob_abs_diff"] == pytest.approx(0.0, abs=1e-5)
    assert m["n_tokens"] == 13 and m["n_seqs"] == 4 and m["step_skipped"] == 0
    assert 0 < m["entropy"] <= math.log(20) + 1e-6
    assert any(d.abs().max() > 0 for d in deltas)


def test_constant_norm_length_reaches_the_loss():
    # loss_agg_norm_length = 10: -15.5 / (4 * 10) = -0.3875
    model = tiny_model()
    cfg = LossConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_agg_norm_length=10)
    m, _, _ = run(cfg, model, make_batch(model))
    assert m["loss"] == pytest.approx(-0.3875, abs=1e-5)


VARIANTS = {
    "ppo": dict(clip_eps_high=0.28, dual_clip_c=3.0),
    "gspo": dict(policy_loss="gspo", gspo_clip_eps_low=0.05, gspo_clip_eps_high=0.05),
    "sapo": dict(policy_loss="sapo"),
    "m2po": dict(policy_loss="m2po"),
    "decoupled": dict(use_decoupled_loss=True, behavior_imp_weight_cap=1.3),
    "kl_entropy": dict(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_two_micro_batches_equal_one_batch(mode, variant):
    model = tiny_model()
    batch = make_batch(model, noise=0.3)  # off-policy: some tokens clip / get masked
    batch["ref_logprobs"] = batch["behavior_logprobs"] - 0.05
    cfg = LossConfig(loss_agg_mode=mode, **VARIANTS[variant])
    m1, d1, _ = run(cfg, model, batch, mbs=5)
    m2, d2, _ = run(cfg, model, batch, mbs=2)  # micro-batches of 2, 2, 1 rows
    for key in ("loss", "policy_loss", "clip_frac", "entropy", "importance_weight_mean", "kl_behavior_current",
                "behavior_logprob_abs_diff"):
        assert m2[key] == pytest.approx(m1[key], abs=1e-5, rel=1e-4), key
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
    assert m1["grad_norm"] > 0
    for a, b in zip(d1, d2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_decoupled_ppo_uses_proximal_policy_and_caps_weight():
    # behavior = current - 0.5 on every token: ratio to behavior = e^0.5 = 1.648721
    model = tiny_model()
    batch = make_batch(model, shift=0.5)
    w = math.exp(0.5)
    # standard PPO (eps 0.2): A>0 tokens clipped at 1.2, A<0 tokens unclipped
    #   sum = -1.2 * (3*1 + 0.5 + 7*2) + w * (2*1) = -21 + 3.297443 = -17.702557; /13 = -1.361735
    #   clip_frac = (3 + 1 + 7) / 13
    m, _, _ = run(LossConfig(), model, batch)
    assert m["loss"] == pytest.approx(-17.702557 / 13, abs=1e-5)
    assert m["clip_frac"] == pytest.approx(11 / 13)
    assert m["importance_weight_mean"] == pytest.approx(w, abs=1e-5)
    # k3 of KL(behavior || current): log r = 0.5 -> e^0.5 - 1 - 0.5 = 0.148721
    assert m["kl_behavior_current"] == pytest.approx(0.148721, abs=1e-5)
    # |log pi_theta - log pi_behav| = 0.5 on every token
    assert m["behavior_logprob_abs_diff"] == pytest.approx(0.5, abs=1e-5)
    # decoupled: proximal = current weights -> u = 1, never clipped; loss = w * (-A):
    #   -w * 15.5 / 13 = -1.965783
    m, _, _ = run(LossConfig(use_decoupled_loss=True, behavior_imp_weight_cap=None), model, batch)
    assert m["loss"] == pytest.approx(-w * 15.5 / 13, abs=1e-5)
    assert m["clip_frac"] == 0.0
    # cap 1.5 < w, mode "mask": every token dropped -> loss 0, no gradient
    cfg = LossConfig(use_decoupled_loss=True, behavior_imp_weight_cap=1.5, behavior_imp_weight_mode="mask")
    m, deltas, _ = run(cfg, model, batch)
    assert m["loss"] == 0.0 and m["behavior_imp_weight_capped_frac"] == 1.0
    assert all(torch.all(d == 0) for d in deltas)
    # cap 1.5, mode "truncate": -1.5 * 15.5 / 13 = -1.788462
    cfg = LossConfig(use_decoupled_loss=True, behavior_imp_weight_cap=1.5, behavior_imp_weight_mode="truncate")
    m, _, _ = run(cfg, model, batch)
    assert m["loss"] == pytest.approx(-1.5 * 15.5 / 13, abs=1e-5)


def test_decoupled_gradient_is_the_behavior_weight_times_the_on_policy_gradient():
    """AReaL eq. 5 at the step's start: u = pi_theta / pi_prox = 1 (the proximal policy is the
    weights before the update, read from the training forward itself), so the gradient of
    -w * A * u is w * (-A grad log pi_theta): w = e^0.5 times that of the on-policy batch."""
    model = tiny_model()
    w = math.exp(0.5)
    _, on_policy, _ = run(LossConfig(), model, make_batch(model), mbs=2)
    _, decoupled, _ = run(LossConfig(use_decoupled_loss=True, behavior_imp_weight_cap=None), model,
                          make_batch(model, shift=0.5), mbs=2)
    assert any(d.abs().max() > 0 for d in on_policy)
    for a, b in zip(on_policy, decoupled):
        torch.testing.assert_close(b, w * a, atol=1e-6, rtol=1e-4)


def test_temperature_reaches_the_recomputed_logprobs():
    model = tiny_model()
    hot = make_batch(model, temperature=2.0)
    m, _, _ = run(LossConfig(), model, hot, temperature=2.0)
    assert m["importance_weight_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy at T=2
    assert m["loss"] == pytest.approx(ON_POLICY_LOSS["token-mean"], abs=1e-5)
    # at T=1 the ratio is exp(log p_T1 - log p_T2), computed here directly from the model
    m, _, _ = run(LossConfig(), model, hot, temperature=1.0)
    with torch.no_grad():
        lp1 = token_logprobs(model, hot["input_ids"], hot["attention_mask"], temperature=1.0)
    valid = hot["loss_mask"].bool()
    expected = torch.exp(lp1 - hot["behavior_logprobs"])[valid].mean().item()
    assert abs(expected - 1.0) > 1e-3
    assert m["importance_weight_mean"] == pytest.approx(expected, abs=1e-5)


def test_kl_loss_and_entropy_bonus_reach_the_loss():
    model = tiny_model()
    batch = make_batch(model)
    # ref = current + 0.2 -> log r = 0.2 per token; k1 = -0.2, k3 = e^0.2 - 1.2 = 0.0214028
    batch["ref_logprobs"] = batch["behavior_logprobs"] + 0.2
    m, _, _ = run(LossConfig(kl_coef=0.1, kl_estimator="k1"), model, batch)
    assert m["loss"] == pytest.approx(ON_POLICY_LOSS["token-mean"] - 0.02, abs=1e-5)
    assert m["kl_ref"] == pytest.approx(-0.2, abs=1e-5)
    m, _, _ = run(LossConfig(kl_coef=0.1, kl_estimator="k3"), model, batch)
    assert m["loss"] == pytest.approx(ON_POLICY_LOSS["token-mean"] + 0.00214028, abs=1e-5)
    # kl_in_reward: the loss has no KL term
    m, _, _ = run(LossConfig(kl_coef=0.1, kl_in_reward=True), model, batch)
    assert m["loss"] == pytest.approx(ON_POLICY_LOSS["token-mean"], abs=1e-5)
    # ref model identical to the policy: KL = 0
    del batch["ref_logprobs"]
    m, _, _ = run(LossConfig(kl_coef=0.1), model, batch, ref_model=copy.deepcopy(model))
    assert m["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        run(LossConfig(kl_coef=0.1), model, batch)
    # entropy bonus: token-mean loss = policy - coef * mean entropy
    m, _, _ = run(LossConfig(entropy_coef=0.05), model, batch)
    assert m["loss"] == pytest.approx(m["policy_loss"] - 0.05 * m["entropy"], abs=1e-5)


def test_all_masked_batch_gives_zero_loss_and_no_step():
    model = tiny_model()
    batch = make_batch(model)
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    m, deltas, _ = run(LossConfig(loss_agg_mode="seq-mean-token-mean", use_decoupled_loss=True), model, batch)
    assert m["loss"] == 0.0 and m["step_skipped"] == 1.0 and m["n_tokens"] == 0
    assert all(math.isfinite(v) for v in m.values())
    assert all(torch.all(d == 0) for d in deltas)


def test_non_finite_gradient_skips_the_step():
    model = tiny_model()
    batch = make_batch(model)
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    m, deltas, _ = run(LossConfig(), model, batch)
    assert m["step_skipped"] == 1.0
    assert all(torch.all((d == 0) | torch.isnan(d)) for d in deltas)


def test_ppo_with_critic_value_loss_and_accumulation():
    model, critic = tiny_model(), TinyCritic()
    batch = make_batch(model)
    algo_for_values = BaseAlgorithm(LossConfig(), model, torch.optim.SGD(model.parameters(), lr=0.0),
                                    micro_batch_size=2, max_grad_norm=1.0, critic=critic,
                                    critic_optimizer=torch.optim.SGD(critic.parameters(), lr=0.0))
    values = algo_for_values.compute_values(batch["input_ids"], batch["attention_mask"])
    # returns = old values + 1 -> (V - R)^2 = 1 on every token, clipped branch equal -> 0.5 per token
    batch.update(values=values, returns=values + 1.0)
    deltas = []
    for mbs in (5, 2):
        c = copy.deepcopy(critic)
        copt = torch.optim.SGD(c.parameters(), lr=1.0)
        before = [p.detach().clone() for p in c.parameters()]
        m, _, _ = run(LossConfig(), model, batch, mbs=mbs, cls=get_algorithm("ppo"), critic=c, critic_optimizer=copt)
        assert m["value_loss"] == pytest.approx(0.5, abs=1e-5)
        assert m["value_clip_frac"] == 0.0 and m["critic_grad_norm"] > 0
        deltas.append([b - p.detach() for b, p in zip(before, c.parameters())])
    for a, b in zip(*deltas):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_batch_validation_errors():
    model = tiny_model()
    batch = make_batch(model)
    algo = BaseAlgorithm(LossConfig(), model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2,
                         max_grad_norm=1.0)
    with pytest.raises(KeyError, match="advantages"):
        algo.update_parameters({k: v for k, v in batch.items() if k != "advantages"})
    bad = dict(batch, loss_mask=batch["attention_mask"].clone())
    with pytest.raises(ValueError, match="first token"):
        algo.update_parameters(bad)
    bad_mask = batch["loss_mask"].clone()
    bad_mask[4, -1] = 1  # row 4 is padding there
    with pytest.raises(ValueError, match="padding"):
        algo.update_parameters(dict(batch, loss_mask=bad_mask))
    adv = batch["advantages"].clone()
    adv[0, 2] = float("nan")
    with pytest.raises(ValueError, match="advantages"):
        algo.update_parameters(dict(batch, advantages=adv))


# ------------------------------------------------------------------ registry
def test_builtin_algorithms_registered_with_valid_defaults():
    names = {"ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "sapo", "m2po", "lite_ppo",
             "decoupled_ppo"}
    assert names <= set(registered_algorithms())
    for name in names:
        cls = get_algorithm(name)
        assert cls.name == name
        assert cls.default_estimator in ESTIMATORS
        cfg = cls.default_loss_config()
        assert cls.policy_loss in (None, cfg.policy_loss)
    assert get_algorithm("gspo").default_loss_config().policy_loss == "gspo"
    assert get_algorithm("dapo").default_loss_config().clip_eps_high == 0.28
    assert get_algorithm("dr_grpo").default_loss_config().loss_agg_mode == "seq-mean-token-sum-norm"
    assert get_algorithm("decoupled_ppo").default_loss_config().use_decoupled_loss is True


def test_unknown_algorithm_lists_registered_names():
    with pytest.raises(ValueError, match=r"unknown algorithm 'grpoo'; registered: \[.*'grpo'.*'ppo'"):
        get_algorithm("grpoo")


def test_user_subclass_selectable_by_name():
    @register_algorithm("test_user_algo")
    class UserAlgo(BaseAlgorithm):
        default_estimator = "rloo"
        loss_defaults = {"clip_eps_high": 0.3}

    try:
        assert "test_user_algo" in registered_algorithms()
        model = tiny_model()
        algo = build_algorithm("test_user_algo", model, torch.optim.SGD(model.parameters(), lr=0.1),
                               micro_batch_size=2, max_grad_norm=1.0, loss_overrides={"kl_coef": 0.0})
        assert type(algo) is UserAlgo and algo.loss_cfg.clip_eps_high == 0.3
        m = algo.update_parameters(make_batch(model))
        assert m["loss"] == pytest.approx(ON_POLICY_LOSS["token-mean"], abs=1e-5)
        with pytest.raises(ValueError, match="already registered"):
            register_algorithm("test_user_algo")(type("Other", (BaseAlgorithm,), {}))
    finally:
        registry._REGISTRY.pop("test_user_algo", None)


def test_registry_and_config_errors():
    with pytest.raises(TypeError, match="BaseAlgorithm subclass"):
        register_algorithm("not_an_algo")(object)
    with pytest.raises(ValueError, match="unknown loss config key"):
        get_algorithm("grpo").default_loss_config(clip_eps=0.1)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="policy_loss='gspo'"):
        get_algorithm("gspo")(LossConfig(), model, opt, micro_batch_size=2, max_grad_norm=1.0)


# ------------------------------------------------------------------ DAPO
def _group(gid, rewards):
    return [Trajectory(f"{gid}:{i}", gid, [1], [2], [-0.1], [0], "stop", reward=r) for i, r in enumerate(rewards)]


def test_informative_groups_mask():
    # group 0 [1, 0] kept; group 1 [0.1, 0.1, 0.1] dropped; group 2 singleton dropped
    r = torch.tensor([1.0, 0.0, 0.1, 0.1, 0.1, 1.0])
    g = torch.tensor([0, 0, 1, 1, 1, 2])
    assert informative_groups(r, g).tolist() == [True, True, False, False, False, False]


def test_fill_dynamic_batch_keeps_asking_until_full():
    calls = iter([[_group(0, [1, 1]), _group(1, [0, 1])], [_group(2, [0, 0])], [_group(3, [1, 0]), _group(4, [0, 1])]])
    out = fill_dynamic_batch(lambda: next(calls), 2, max_attempts=5)
    assert [grp[0].group_id for grp in out] == [1, 3]


def test_fill_dynamic_batch_bounded_with_clear_error():
    with pytest.raises(RuntimeError, match=r"0/2 groups .* after 3 calls \(3 groups sampled, 3 dropped"):
        fill_dynamic_batch(lambda: [_group(0, [1.0, 1.0])], 2, max_attempts=3)
    with pytest.raises(ValueError, match="no reward"):
        fill_dynamic_batch(lambda: [_group(0, [None, 1.0])], 1, max_attempts=1)


def test_overlong_penalty_by_hand():
    # L_max 10, L_cache 4 -> soft zone (6, 10]: 5 -> 0; 6 -> 0; 7 -> (6-7)/4 = -0.25; 10 -> -1; 11 -> -1
    got = overlong_penalty(torch.tensor([5, 6, 7, 10, 11]), max_length=10, cache_length=4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -1.0, -1.0]))
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(torch.tensor([1]), max_length=4, cache_length=5)
