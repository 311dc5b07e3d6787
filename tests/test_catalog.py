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
        assert catalog.algorithm_info("test_catalog_user_algo") == catalog.AlgorithmInfo("test_catalog_user_algo", "rloo")
        assert "test_catalog_user_algo" in catalog.algorithm_names()
    finally:
        registry._REGISTRY.pop("test_catalog_user_algo")
    assert catalog.algorithm_info("test_catalog_user_algo") is None


def test_presets_are_what_the_builders_make():
    assert CHAR_VOCAB_SIZE == len(build_char_tokenizer()) == 50  # 4 special + 10 digits + 10 symbols + 26 letters
    model = build_model("tiny-arith", CHAR_VOCAB_SIZE)
    assert model.config.hidden_size == PRESETS["tiny-arith"].hidden_size == 128
    assert model.config.num_hidden_layers == PRESETS["tiny-arith"].num_hidden_layers == 4
