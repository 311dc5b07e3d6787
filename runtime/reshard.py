"""Loading a train_step's checkpoint into another parallel layout than the one that wrote it.

Owns the conversion between the two forms a checkpoint keeps a policy's model and AdamW
state in (``runtime.checkpoint``) and the trainer layouts it can be loaded into:

* **whole** (a train_step of one process): the weights in ``model.safetensors``
  (``transformers``) and the optimizer's own ``state_dict`` in ``trainer_state.pt``
  (state keyed by the parameter's position in ``model.parameters()``);
* **sharded** (a train_step of several ranks): ``trainer_dcp/``, written by
  ``torch.distributed.checkpoint`` from ``get_state_dict``: every tensor stored once as a
  *global* tensor named by its fully qualified name (FQN), each rank's file holding its
  slices, ``.metadata`` their offsets; the optimizer state flattened to one entry per
  parameter (:data:`FLAT`, what torchtitan does for pipeline stages).

============  ===========================================  ==========================================
checkpoint    trainer of one process                       trainer of several ranks (dp, tp, pp)
============  ===========================================  ==========================================
whole         ``load_state_dict`` (``runtime.executors``)   :func:`load_whole_into_ranks`
sharded       :func:`load_sharded` (no process group)       :func:`load_sharded` (every rank its slice)
============  ===========================================  ==========================================

DCP matches saved and wanted tensors by FQN and global offsets, so a sharded checkpoint loads
into any sharding of the same tensors (FSDP2's ``Shard(0)`` over dp, DTensor TP's
row/column shards and replicas, or whole tensors in one process): PyTorch docs,
"Distributed Checkpoint - torch.distributed.checkpoint" (load-time resharding) and
``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` / ``set_state_dict``, FQN-keyed
optimizer state). AdamW's moments are shaped like their parameters, so they reshard with
them; the step counts are scalars. Every path copies the stored fp32 values: nothing is
recomputed, so the loaded tensors equal the checkpoint's bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


ONE_PROCESS_LOAD = "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load"
"""The start of the ``UserWarning`` ``dcp.load`` gives in a process without a process group (torch 2.13)."""

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
"""How several ranks save the optimizer: one entry per parameter and field (``state.<fqn>.exp_avg``,
``param_groups.<fqn>.lr``), so pipeline stages, whose parameter groups differ, never write one key."""


def rename_parameters(optimizer_state: dict, names: dict[str, str] | None) -> dict:
    """A flattened optimizer state (:data:`FLAT`) with parameter FQNs renamed, ``{old: new}``:
    the last pipeline stage's copy of a tied embedding (``lm_head.weight``) is stored under the
    tied parameter's first name (``model.embed_tokens.weight``), as one process stores it."""
    if not names:
        return optimizer_state
    out = {}
    for key, value in optimizer_state.items():
        for old, new in names.items():
            for section in ("state.", "param_groups."):
                if key.startswith(f"{section}{old}."):
                    key = f"{section}{new}{key[len(section) + len(old):]}"
        out[key] = value
    return out


_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def experts_as_dtensors(module: torch.nn.Module, experts: tuple[list, DeviceMesh] | None, model_state: dict,
                        optimizer_state: dict) -> set[str]:
    """Under expert parallelism, view this rank's expert blocks (plain tensors outside FSDP,
    ``[n_experts / ep, ...]``, the same FQN on every rank) in ``model_state`` and the flattened
    ``optimizer_state`` (moments; not the 0-dim ``step``) as ``DTensor`` shards ``Shard(0)`` of
    the global ``[n_experts, ...]`` tensor over the ``ep`` mesh, in place, so that DCP saves
    every rank's block at its offset (a plain tensor counts as replicated and DCP keeps one
    rank's copy: the other blocks were lost) and loads each rank's block back, into any
    strategy. ``experts``: ``(this rank's expert parameters, the ep mesh)``; None: nothing to do.
    Returns the keys replaced (for :func:`experts_as_local`).

    Raises:
        RuntimeError: an expert parameter's name is not in ``model_state`` (names it).
    """
    if experts is None:
        return set()
    params, ep_mesh = experts
    ids = {id(p) for p in params}
    names = set()
    for name, param in module.named_parameters():
        if id(param) in ids:
            for wrapper in _WRAPPERS:
                name = name.replace(wrapper, "")
            names.add(name)
    if missing := sorted(names - model_state.keys()):
        raise RuntimeError(f"expert parameters {missing[:3]} are not in the model's state dict")
    replaced = set()
    for state, keys in ((model_state, {n: n for n in names}),
                        (optimizer_state, {k: k[len("state."):].rsplit(".", 1)[0] for k in optimizer_state
                                           if k.startswith("state.")})):
        for key, fqn in keys.items():
            value = state[key]
            if fqn in names and torch.is_tensor(value) and value.dim() > 0 and not isinstance(value, DTensor):
                state[key] = DTensor.from_local(value, ep_mesh, [Shard(0)], run_check=False)
                replaced.add(key)
    return replaced


def experts_as_local(state: dict, keys: set[str]) -> dict:
    """``state`` with the :func:`experts_as_dtensors` views of ``keys`` back as this rank's blocks."""
    return {k: v.to_local() if k in keys else v for k, v in state.items()}


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str | Path,
                 names: dict[str, str] | None = None, experts: tuple[list, DeviceMesh] | None = None) -> None:
    """Load a sharded checkpoint's ``folder`` (``trainer_dcp/``: keys ``model`` and
    ``optimizer``) into ``model`` and its ``optimizer``, whatever their layout: on several
    ranks (FSDP2 / DTensor TP module, pipeline stage; every rank calls it, collectives) each
    rank reads the slices of the global tensors its shards cover; in a process without a
    process group (a one-process trainer) the whole tensors. The optimizer state is read in
    the form it was written: flattened (:data:`FLAT`), or nested (checkpoints written before
    it, which no pipeline stage can read). ``names``: :func:`rename_parameters`' renames of
    this rank's parameters to the checkpoint's. ``experts``: under expert parallelism, this
    rank's expert parameters and the ep mesh (:func:`experts_as_dtensors`).

    Raises:
        FileNotFoundError / RuntimeError (from DCP): ``folder`` holds no DCP checkpoint, or one
            of other tensors (DCP names the missing keys or the mismatched shapes).
        ValueError: a nested-optimizer checkpoint into a pipeline stage with renames.
    """
    keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    flat = "optimizer.param_groups.0.lr" not in keys
    if names and not flat:
        raise ValueError(f"checkpoint {folder}: its optimizer state is nested (written before pipeline stages "
                         "could load it); resume it on a strategy without pp")
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    local = experts_as_dtensors(model, experts, model_state, optim_state)
    state = {"model": model_state, "optimizer": rename_parameters(optim_state, names)}
    with warnings.catch_warnings():
        # Harmless: without a process group (a one-process trainer resuming a multi-rank checkpoint)
        # DCP warns that it loads in this process alone, which is what we want (even with no_dist=True).
        warnings.filterwarnings("ignore", message=ONE_PROCESS_LOAD, category=UserWarning)
        dcp.load(state, checkpoint_id=str(folder))
    back = {new: old for old, new in (names or {}).items()}
    set_state_dict(model, optimizer, model_state_dict=experts_as_local(state["model"], local),
                   optim_state_dict=experts_as_local(rename_parameters(state["optimizer"], back), local),
                   options=options)


def whole_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The FQN-keyed whole state of ``model`` and ``optimizer`` on CPU: ``(model_state,
    optimizer_state)``, every tensor full-size (``get_state_dict`` with
    ``full_state_dict=True, cpu_offload=True``; on several ranks a collective, rank 0 gets the
    tensors and the other ranks empty dicts). Optimizer state: ``{"state": {fqn: {"step",
    "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}``."""
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_whole_into_ranks(module: torch.nn.Module, optimizer: torch.optim.Optimizer, model_folder: str | Path,
                          optimizer_state: dict, names: dict[str, str] | None = None,
                          load: Callable[[Path], torch.nn.Module] | None = None) -> None:
    """Load a one-process checkpoint into this rank's shards (every rank calls it and reads the
    whole checkpoint, keeping its own piece).

    Each rank reads the whole weights from ``model_folder`` into a plain copy of the model,
    builds AdamW on it and loads ``optimizer_state`` (the positional ``state_dict``), so that
    ``get_state_dict`` names the moments by FQN as the sharded module does; every weight and
    moment is then cut to this rank's placement (:func:`_cut`) and loaded
    (``set_model_state_dict`` / ``set_optimizer_state_dict``), for the parameters ``module``
    holds (a pipeline stage: its own; ``names`` as :func:`load_sharded`'s). ``load``: how the whole model is read from
    ``model_folder`` (default: the causal LM, ``model_source.load_pretrained``; a critic passes
    ``ValueModel.load``). Peak memory: one whole model and its AdamW state per rank, for the
    duration of the call.

    Raises:
        ValueError: ``optimizer_state`` does not fit the model (torch's message: parameter
            counts of the groups differ).
        RuntimeError: weights that do not fit ``module`` (torch names the keys).
        KeyError: ``module`` holds a parameter the checkpoint lacks.
    """
    from runtime.model_source import load_pretrained

    plain = load(Path(model_folder)) if load is not None else load_pretrained(model_folder)[0]
    plain_optimizer = torch.optim.AdamW(plain.parameters())
    plain_optimizer.load_state_dict(optimizer_state)  # lr, betas, weight decay come from the state
    model_state, optim_state = get_state_dict(plain, plain_optimizer)
    held_model, held_optim = get_state_dict(module, optimizer)
    names = names or {}
    held = [fqn for group in held_optim["param_groups"] for fqn in group["params"]]
    optim_state = {  # the parameters this rank holds, by its names
        "state": {fqn: optim_state["state"][names.get(fqn, fqn)] for fqn in held},
        "param_groups": [{**group, "params": [fqn for fqn in held if names.get(fqn, fqn) in group["params"]]}
                         for group in optim_state["param_groups"]],
    }
    set_model_state_dict(module, {k: _cut(model_state[k], held) for k, held in held_model.items()})
    optim_state["state"] = {fqn: {field: _cut(value, held_optim["state"][fqn][field])
                                  for field, value in fields.items()} for fqn, fields in optim_state["state"].items()}
    set_optimizer_state_dict(module, optimizer, optim_state)


def _cut(whole: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``whole`` in the layout of ``held`` (its own tensor: a ``DTensor``
    shard, or a plain tensor or scalar). Every rank holds ``whole``, so each cuts its piece
    locally (``distribute_tensor`` with ``src_data_rank=None``: no scatter), which also cuts
    FSDP2's uneven strided shards of a TP-split tensor (``dp x tp``: a vocabulary of 50 rows
    over 2 x 2 ranks) that the scatter of ``set_state_dict(full_state_dict=True)`` refuses."""
    if isinstance(held, DTensor):
        return distribute_tensor(whole.to(held.device), held.device_mesh, held.placements, src_data_rank=None)
    return whole.to(held.device) if whole.dim() else whole
