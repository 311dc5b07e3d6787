"""The torch-free catalog of algorithms and estimators equals the real code, and the
tiny presets' plain data equals what the model and tokenizer builders make."""

import inspect

import torch

from areal_flow.algorithms import catalog
from areal_flow.algorithms.advantages import ESTIMATORS, compute_advantages
from areal_flow.algorithms.lookup import get_algorithm, registered_algorithms
from areal_flow.models.presets import CHAR_VOCAB_SIZE, PRESETS
from areal_flow.models.tiny import build_model
from areal_flow.models.tokenizer import build_char_tokenizer


def test_algorithm_table_equals_the_registry():
    assert set(catalog.ALGORITHMS) == set(registered_algorithms())
    for name in registered_algorithms():
        assert catalog.ALGORITHMS[name] == catalog.info_of(get_algorithm(name)), name
    # By hand from builtin.py: PPO alone needs a critic, REINFORCE++ alone folds the KL into the reward.
    assert [n for n, a in catalog.ALGORITHMS.items() if a.requires_critic] == ["ppo"]
    assert [n for n, a in catalog.ALGORITHMS.items() if a.kl_in_reward] == ["reinforce_pp"]


def test_estimator_table_equals_the_estimators():
    assert list(catalog.ESTIMATORS) == list(ESTIMATORS)
    # Two responses of 3 tokens, one group; every input any estimator takes.
    mask = torch.ones(2, 3)
    inputs = dict(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]), loss_mask=mask,
                  values=torch.zeros(2, 3), turn_rewards=torch.ones(2, 1), turn_ids=torch.zeros(2, 3, dtype=torch.long))
    for name, fn in ESTIMATORS.items():
        params = inspect.signature(fn).parameters
        info = catalog.ESTIMATORS[name]
        assert info.needs_values == ("values" in params), name
        assert info.takes_kl == ("kl" in params), name
        assert info.gives_returns == (compute_advantages(name, **inputs).returns is not None), name
        # Knobs: the keyword defaults, less what the advantage executor fills (KL, group ids).
        defaults = [p for p, v in params.items() if v.default is not inspect.Parameter.empty]
        assert list(info.knobs) == [p for p in defaults if p not in ("kl", "kl_coef", "group_ids")], name
    assert catalog.ESTIMATORS["gae"].knobs == ("gamma", "lam")  # GAE(gamma, lambda), Schulman et al. 2016


def test_user_registered_algorithm_is_known_to_the_catalog():
    from areal_flow.algorithms import registry
    from areal_flow.algorithms.base import BaseAlgorithm

    @registry.register_algorithm("test_catalog_user_algo")
    class UserAlgo(BaseAlgorithm):
        default_estimator = "rloo"

    try:
        # it sets no policy_loss: any (BaseAlgorithm's None), and no loss defaults
        assert catalog.algorithm_info("test_catalog_user_algo") == catalog.AlgorithmInfo("test_catalog_user_algo", "rloo",
                                                                                         policy_loss=None)
        assert "test_catalog_user_algo" in catalog.algorithm_names()
    finally:
        registry._REGISTRY.pop("test_catalog_user_algo")
    assert catalog.algorithm_info("test_catalog_user_algo") is None


def test_presets_are_what_the_builders_make():
    assert CHAR_VOCAB_SIZE == len(build_char_tokenizer()) == 50  # 4 special + 10 digits + 10 symbols + 26 letters
    model = build_model("tiny-arith", CHAR_VOCAB_SIZE)
    assert model.config.hidden_size == PRESETS["tiny-arith"].hidden_size == 128
    assert model.config.num_hidden_layers == PRESETS["tiny-arith"].num_hidden_layers == 4


def test_builtin_classes_are_made_from_the_one_table():
    from areal_flow.algorithms import builtin

    assert set(builtin.BUILTIN) == set(catalog.ALGORITHMS)
    dapo = get_algorithm("dapo")
    assert dapo is builtin.BUILTIN["dapo"] and dapo.__module__ == "areal_flow.algorithms.builtin"
    # DAPO's clip-higher (Yu et al. 2025, sec. 3.1): 0.2 below, 0.28 above; the rest LossConfig's defaults
    cfg = dapo.default_loss_config()
    assert (cfg.clip_eps_low, cfg.clip_eps_high, cfg.loss_agg_mode, cfg.use_decoupled_loss) == (0.2, 0.28, "token-mean",
                                                                                               False)
    assert get_algorithm("gspo").policy_loss == "gspo" and get_algorithm("ppo").requires_critic
    assert "Yu et al. 2025" in dapo.__doc__  # the row's paper is the class docstring


def test_a_builtin_name_cannot_be_taken_and_a_reimport_replaces():
    import pytest

    from areal_flow.algorithms import registry
    from areal_flow.algorithms.base import BaseAlgorithm

    with pytest.raises(ValueError, match="algorithm 'grpo' is built in; register yours under another name"):
        registry.register_algorithm("grpo")(type("Mine", (BaseAlgorithm,), {}))
    first = registry.register_algorithm("test_catalog_twice")(type("Twice", (BaseAlgorithm,), {"__module__": "m"}))
    again = registry.register_algorithm("test_catalog_twice")(type("Twice", (BaseAlgorithm,), {"__module__": "m"}))
    try:  # the same module and name (a graph file imported again, a plan's copy) replaces the first
        assert get_algorithm("test_catalog_twice") is again is not first
        with pytest.raises(ValueError, match="already registered to m.Twice"):
            registry.register_algorithm("test_catalog_twice")(type("Other", (BaseAlgorithm,), {"__module__": "m"}))
    finally:
        registry._REGISTRY.pop("test_catalog_twice")


def test_user_estimator_metadata_comes_from_its_signature_and_it_runs():
    import pytest

    def centered(rewards, group_ids, loss_mask, values, *, scale=1.0, kl=None, kl_coef=0.0):
        """r - mean(group), times scale, on every response token."""
        from areal_flow.algorithms.returns import AdvantageOutput

        means = {int(g): float(rewards[group_ids == g].mean()) for g in group_ids.unique()}
        centred = torch.tensor([scale * (float(r) - means[int(g)]) for r, g in zip(rewards, group_ids)])
        return AdvantageOutput(centred[:, None] * loss_mask, None)

    catalog.register_estimator("test_catalog_centered")(centered)
    try:
        info = catalog.estimator_info("test_catalog_centered")
        # values -> needs a critic; kl -> takes the KL; knobs: the defaults but kl, kl_coef, group_ids
        assert info == catalog.EstimatorInfo("test_catalog_centered", needs_values=True, gives_returns=False,
                                             takes_kl=True, knobs=("scale",))
        assert catalog.estimator_names()[-1] == "test_catalog_centered"
        out = compute_advantages("test_catalog_centered", rewards=torch.tensor([1.0, 0.0, 3.0]),
                                 group_ids=torch.tensor([0, 0, 1]), loss_mask=torch.ones(3, 2),
                                 values=torch.zeros(3, 2), scale=2.0)
        # group 0: mean 0.5 -> 2 x (+0.5, -0.5); group 1 alone: 0
        assert out.advantages.tolist() == [[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]]
        with pytest.raises(ValueError, match="estimator 'grpo' is built in"):
            catalog.register_estimator("grpo")(centered)
    finally:
        catalog._USER_ESTIMATORS.pop("test_catalog_centered")
    assert catalog.estimator_info("test_catalog_centered") is None
