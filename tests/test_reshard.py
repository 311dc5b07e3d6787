"""Resharding a train_step's checkpoint to another world size or strategy (issue 13,
``runtime.reshard``): the model and AdamW state a checkpoint holds, loaded into another
layout, equal the checkpoint's whole tensors bit for bit.

Five checkpoints of the tiny policy (tied embedding) after AdamW steps on the batch of
``rl_step_cases``: ``d1`` (one process: ``model.safetensors`` + the optimizer's positional
``state_dict``), ``d2`` (FSDP2), ``t2`` (DTensor TP, two steps so that it differs from ``d2``)
and ``p2`` (two pipeline stages, three steps; the tied matrix's second copy on the last stage),
the last three written by DCP. Each is loaded into other layouts (one process, d2, t2, p2);
what the loaded trainer holds is gathered whole (a pipeline's stages merged, the tied copy's
moments checked equal to the first's) and compared with ``torch.equal`` to what the
checkpoint's files hold, read independently of the code under test: DCP's own converter
(``dcp_to_torch_save``) for ``trainer_dcp/``; the safetensors file and the positional AdamW
state named by ``named_parameters()`` order (``torch.optim.Optimizer.state_dict``: parameters
are numbered in the order they were given) for a one-process checkpoint.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_flow.algorithms.lookup import build_algorithm
from areal_flow.models.tiny import build_model
from areal_flow.models.tokenizer import build_char_tokenizer
from compiler.strategy import ParallelStrategy
from runtime.checkpoint import SHARDED_DIR, STATE_FILE
from runtime.model_source import load_pretrained
from runtime.parallel.launch import spawn_workers
from runtime.parallel_trainer import RankTrainer
from runtime.reshard import load_sharded
from rl_step_cases import LR, rl_batch, settings

NODE = "train_step"
LOADS = [("d2", 2, "t2"), ("t2", 2, "d2"), ("d1", 1, "d2"), ("d1", 1, "t2"),  # (checkpoint, its world size, into)
         ("p2", 2, "d2"), ("d2", 2, "p2"), ("d1", 1, "p2")]
STEPS = {"d2": 1, "t2": 2, "p2": 3}  # AdamW steps before each sharded checkpoint
MOMENTS = ("step", "exp_avg", "exp_avg_sq")


def _held(trainer: RankTrainer) -> tuple[dict, dict]:
    """``(weights, moments by FQN)`` this rank's stage holds, whole (FSDP and TP gathered)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(trainer.parallel.module, trainer.algorithm.optimizer,
                                  options=StateDictOptions(full_state_dict=True))
    return {k: v.cpu() for k, v in model.items()}, {k: {f: torch.as_tensor(t).cpu() for f, t in v.items()}
                                                     for k, v in optim["state"].items()}


def _save_and_load_on_ranks(rank: int, world_size: int, root: Path, batch: dict) -> dict:
    """Worker: write the d2, t2 and p2 checkpoints, then load each checkpoint of :data:`LOADS`
    into a fresh trainer of another strategy; returns what each rank holds, whole."""
    import torch.distributed as dist

    for strategy, steps in STEPS.items():
        trainer = RankTrainer.build(settings(root / "policy", "grpo"), ParallelStrategy.parse(strategy))
        for _ in range(steps):
            trainer.step(batch)
        trainer.save_state(root / strategy / SHARDED_DIR)
    dist.barrier()
    loaded = {}
    for source, size, strategy in LOADS:
        trainer = RankTrainer.build(settings(root / "policy", "grpo"), ParallelStrategy.parse(strategy))
        trainer.load_state(root / source, size, NODE)
        loaded[(source, strategy)] = _held(trainer)
    return loaded


def _whole(per_rank: list[dict], key: tuple[str, str]) -> tuple[dict, dict]:
    """Rank 0's, or under pp both stages', weights and moments; the tied copy's moments dropped
    once checked equal to the first copy's (one process keeps them once)."""
    weights, moments = {}, {}
    for result in per_rank if key[1] == "p2" else per_rank[:1]:
        weights.update(result[key][0])
        moments.update(result[key][1])
    if key[1] == "p2":
        copy = moments.pop("lm_head.weight")
        assert all(torch.equal(copy[f], moments["model.embed_tokens.weight"][f]) for f in MOMENTS), key
    return weights, moments


def _one_process_checkpoint(root: Path, batch: dict) -> None:
    """``root/d1``: one AdamW step in one process, saved as a one-process train_step saves it."""
    torch.manual_seed(0)
    model, tokenizer = load_pretrained(root / "policy")
    spec = settings(root / "policy", "grpo")
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    build_algorithm("grpo", model.train(), optimizer, micro_batch_size=spec.micro_batch_size,
                    max_grad_norm=spec.max_grad_norm, temperature=spec.temperature).update_parameters(batch)
    model.save_pretrained(root / "d1")
    tokenizer.save_pretrained(root / "d1")
    torch.save({"optimizers": {NODE: optimizer.state_dict()}}, root / "d1" / STATE_FILE)


def _by_name(model: torch.nn.Module, positional: dict) -> dict[str, dict]:
    """AdamW's positional ``state`` named by ``model.named_parameters()`` order."""
    names = [name for name, _ in model.named_parameters()]
    return {names[i]: state for i, state in positional["state"].items()}


def _expected(root: Path, source: str) -> tuple[dict, dict]:
    """``(weights, moments by name)`` as checkpoint ``root/source`` holds them on disk."""
    if source == "d1":
        plain, _ = load_pretrained(root / "policy")
        return load_file(root / "d1/model.safetensors"), _by_name(plain, torch.load(root / "d1" / STATE_FILE)[
            "optimizers"][NODE])
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(root / source / SHARDED_DIR, root / f"{source}.pt")
    whole = torch.load(root / f"{source}.pt", weights_only=False)
    moments: dict[str, dict] = {}  # the optimizer state is flattened: "state.<fqn>.<field>"
    for key, value in whole["optimizer"].items():
        if key.startswith("state."):
            fqn, field = key.removeprefix("state.").rsplit(".", 1)
            moments.setdefault(fqn, {})[field] = value
    return whole["model"], moments


def _assert_holds(weights: dict, moments: dict, expected: tuple[dict, dict], label: str) -> None:
    want_weights, want_moments = expected
    assert want_weights.keys() <= weights.keys() and len(want_moments) == len(moments) > 0, label
    for name, tensor in want_weights.items():
        assert torch.equal(weights[name], tensor), f"{label}: weight {name}"
    for name, state in want_moments.items():
        assert state["exp_avg_sq"].abs().sum() > 0, f"{label}: {name} was never stepped"  # not zeros against zeros
        for key in MOMENTS:
            assert torch.equal(torch.as_tensor(moments[name][key]), torch.as_tensor(state[key])), f"{label}: {name} {key}"


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("reshard")
    tokenizer = build_char_tokenizer()
    build_model("tiny-s", len(tokenizer), seed=0).save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    batch = rl_batch(root / "policy")
    _one_process_checkpoint(root, batch)
    loaded = spawn_workers(_save_and_load_on_ranks, 2, (root, batch), backend="gloo")
    return root, loaded


@pytest.mark.slow
@pytest.mark.parametrize("source,size,strategy", LOADS)
def test_a_checkpoint_loads_into_two_ranks_of_another_strategy_bit_for_bit(resharded, source, size, strategy):
    root, loaded = resharded
    weights, moments = _whole(loaded, (source, strategy))
    _assert_holds(weights, moments, _expected(root, source), f"{source} -> {strategy}")


@pytest.mark.slow
@pytest.mark.parametrize("source", ["d2", "t2", "p2"])
def test_a_sharded_checkpoint_loads_into_one_process_bit_for_bit(resharded, source):
    root, _ = resharded
    model, _ = load_pretrained(root / "policy")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    load_sharded(model, optimizer, root / source / SHARDED_DIR)  # no process group in this process
    state = {k: v.detach() for k, v in model.state_dict().items()}
    _assert_holds(state, _by_name(model, optimizer.state_dict()), _expected(root, source), f"{source} -> d1")


@pytest.mark.slow
def test_the_checkpoints_differ(resharded):
    """The comparisons above could not pass by loading the wrong checkpoint."""
    root, _ = resharded
    weights = {source: _expected(root, source)[0]["model.norm.weight"] for source in ("d1", "d2", "t2", "p2")}
    initial = load_file(root / "policy/model.safetensors")["model.norm.weight"]
    assert not torch.equal(weights["d2"], weights["t2"]) and not torch.equal(weights["d1"], initial)
    assert not torch.equal(weights["p2"], weights["d2"]) and not torch.equal(weights["p2"], weights["t2"])
    assert not torch.equal(weights["d1"], weights["t2"])


def test_a_checkpoint_with_nested_optimizer_state_still_loads(tmp_path):
    """Sharded checkpoints written before the flattened optimizer state (``reshard.FLAT``) load
    into a layout without pipeline stages; a pipeline stage (renames) is refused by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = build_model("tiny-s", 50, seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model(input_ids=torch.tensor([[1, 5, 7]])).logits.sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)  # nested: {"state": ..., "param_groups": [...]}
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp_path))
    fresh = build_model("tiny-s", 50, seed=1).train()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=LR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_sharded(fresh, fresh_optimizer, tmp_path)
    assert not [w for w in caught if "load in a single process" in str(w.message)]  # DCP's notice: what we want
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    got, want = fresh_optimizer.state_dict()["state"], optimizer.state_dict()["state"]
    assert got.keys() == want.keys() and all(torch.equal(got[i][f], want[i][f]) for i in want for f in MOMENTS)
    with pytest.raises(ValueError, match="optimizer state is nested .* resume it on a strategy without pp"):
        load_sharded(fresh, fresh_optimizer, tmp_path, {"lm_head.weight": "model.embed_tokens.weight"})
