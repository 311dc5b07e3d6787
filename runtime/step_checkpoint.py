"""A step group's checkpoints: what its trained models, optimizers and stateful batch nodes
write at a checkpointed step, and how a resumed (or restarted) group loads them back.

Owns :class:`StepCheckpoints`, used by the stage worker (``runtime.stage_worker``) of every
step group: the layout and the atomic, checksummed write are ``runtime.checkpoint``'s; this
module decides what of the group goes in — each train_step's model (``save``; a multi-rank
one also its ``torch.distributed.checkpoint`` shards, ``SHARDED_DIR``) and optimizer state,
the RNGs, the admission cursor ``version * B``, and the state of every batch node whose
executor is ``areal_flow.ops.interfaces.Checkpointed`` (e.g. the replay buffer of
``ops.replay``), under its node's name in ``trainer_state.pt``. The runtime names no op.
In a chain of step groups each group writes and restores its own part of a version (the
policy trainer's group ``version_<v>/``, every other one ``parts/<group>/version_<v>/``:
``runtime.checkpoint``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from areal_flow.ops.interfaces import Checkpointed
from runtime.checkpoint import (SHARDED_DIR, capture_rng, model_folder, part_folder, read_state, restore_rng,
                                save_checkpoint)


class StepCheckpoints:
    """The checkpoints of one step group.

    Args:
        executors: node name -> its executor. batch_nodes: the group's batch nodes (plan nodes).
        policy: the policy model's name (its weights at the folder's top level).
        batch_groups: prompt groups per step (``B``). keep: ``train.keep_checkpoints`` (0 = all).
        group: the group's name, for the one-line notes on stderr.
        last: the newest complete checkpoint (a resumed run's, ``version_<v>``), or None.
        chain: the plan's step groups in chain order; trainer: the policy trainer's group
            (it writes ``version_<v>/``, listing the others as its parts; ``runtime.checkpoint``).
    """

    def __init__(self, executors: dict, batch_nodes: list, policy: str, batch_groups: int, keep: int, group: str,
                 last: Path | None, chain: tuple[str, ...] = (), trainer: str = "") -> None:
        self.executors, self.batch_nodes, self.policy = executors, batch_nodes, policy
        self.part = group if len(chain) > 1 and group != trainer else None  # None: this group writes version_<v>
        self.parts = tuple(g for g in chain if g != trainer) if self.part is None and len(chain) > 1 else ()
        self.batch_groups, self.keep, self.group = batch_groups, keep, group
        self.last = self.folder(last) if last is not None else None
        self.to_save: dict = {}  # train_step name -> its weights after a checkpointed step
        self.failures = 0  # writes that failed with an OSError (a full disk)

    def folder(self, checkpoint: Path) -> Path:
        """This group's part of checkpoint ``checkpoint`` (``version_<v>``): the folder itself,
        or ``parts/<group>/version_<v>`` beside it for a step group other than the trainer's."""
        return part_folder(checkpoint, self.part) if self.part else checkpoint

    def _trained(self) -> list:
        return [n for n in self.batch_nodes if n.trains]

    def _stateful(self) -> dict:
        """Name -> executor of the batch nodes whose state is checkpointed (``Checkpointed``)."""
        return {n.name: self.executors[n.name] for n in self.batch_nodes
                if isinstance(self.executors[n.name], Checkpointed)}

    def write(self, version: int, root: Path) -> bool:
        """``root/version_<version>``, written atomically (``runtime.checkpoint.save_checkpoint``);
        then the checkpoints beyond ``keep`` are deleted. A write that fails with an ``OSError``
        (a full disk) leaves the complete checkpoints as they were, says so in one line on
        stderr, is counted (:attr:`failures`) and training goes on. Returns whether it was written.
        The weights written are those :attr:`to_save` holds for each train_step (set by the step)."""
        nodes = self._trained()

        def fill(folder: Path) -> None:
            for node in nodes:
                executor = self.executors[node.name]
                executor.save(model_folder(folder, node.model, self.policy), self.to_save.pop(node.name))
                if executor.world_size > 1:  # a sharded optimizer: every rank writes its shards
                    executor.save_sharded(model_folder(folder, node.model, self.policy) / SHARDED_DIR)

        state = {"version": version, "rng": capture_rng(),
                 "optimizers": {n.name: self.executors[n.name].optimizer_state() for n in nodes},
                 "world_sizes": {n.name: self.executors[n.name].world_size for n in nodes},
                 "executors": {name: ex.checkpoint_state() for name, ex in self._stateful().items()}}
        written = save_checkpoint(root, version, fill, state, next_index=version * self.batch_groups,
                                  strategies={n.name: n.strategy for n in nodes if n.strategy}, keep=self.keep,
                                  last=self.last, part=self.part, parts=self.parts,
                                  say=lambda line: print(f"areal-flow: {self.group}: {line}", file=sys.stderr,
                                                         flush=True))
        if written is None:
            self.failures += 1
            return False
        self.last = written
        return True

    def restore(self, folder: Path) -> int:
        """Load this group's part of checkpoint ``folder`` (``version_<v>``, :meth:`folder`) into
        the train_step executors, the ``Checkpointed`` ones and this process's RNGs; return its
        version (the next step).

        Raises:
            ValueError: a checkpointed executor whose node has no state in the checkpoint.
        """
        folder = self.folder(folder)
        state = read_state(folder)
        saved = state.get("executors", {})
        for name, executor in self._stateful().items():
            if name not in saved:
                raise ValueError(f"checkpoint {folder}: no state for node {name!r}, whose state decides what is "
                                 f"trained (it holds {sorted(saved)}: written by a trainer without that node)")
            executor.load_checkpoint_state(saved[name])
        for node in self._trained():
            self.executors[node.name].load_checkpoint(model_folder(folder, node.model, self.policy),
                                                      state["optimizers"][node.name],
                                                      state.get("world_sizes", {}).get(node.name, 1))
        restore_rng(state["rng"])
        return int(state["version"])
