"""A train_step node's settings as the plan gives them (``TrainSettings``), and the split of
a step's rows into micro-batches: what the one-process executor (``runtime.executors.train``)
and the ranks of a multi-rank trainer (``runtime.parallel_trainer``, ``runtime.parallel_critic``)
build their algorithm from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.config import LossConfig
from areal_flow.algorithms.lookup import get_algorithm
from areal_flow.algorithms.lr_schedule import warmup_lr
from compiler.plan import decode_value


@dataclass
class TrainSettings:
    """A train_step node's settings, as ``BaseAlgorithm`` and the ranks need them.

    Attributes:
        model_folder: version-0 weights. algorithm: registered name. loss: the plan's whole
        ``LossConfig`` (field -> value). lr / weight_decay / max_grad_norm: AdamW and clipping.
        lr_warmup_steps: the linear warm-up of lr (``areal_flow.algorithms.lr_schedule``; 0 = off).
        micro_batch_size: sequences per forward/backward (recomputed each step from
        ``micro_batches``). micro_batches: the plan's micro-batches per DP rank
        (``NodePlan.micro_batches``: ``train.gradient_accumulation_steps`` when set).
        activation_checkpointing: the plan's choice for the node (``compile.activation_checkpointing``:
        on, off or the compiler's when auto); every rank recomputes its layers in the backward pass.
        temperature: of the sampler. seed: initialisation seed.
        max_tokens_per_micro_batch / pack_sequences / shared_prefix: ``train.*`` of the same names
        (the policy's micro-batches, ``areal_flow.algorithms.micro_batches``; 0 / False = off).
        user_algorithm: the plan's encoded class of a user-registered algorithm (None: built in),
        so a rank process that never read the graph file builds it too.
    """

    model_folder: str
    algorithm: str
    loss: dict
    lr: float
    weight_decay: float
    max_grad_norm: float
    micro_batch_size: int
    temperature: float
    seed: int
    max_tokens_per_micro_batch: int = 0
    pack_sequences: bool = False
    shared_prefix: bool = False
    user_algorithm: dict | None = None
    micro_batches: int = 1
    activation_checkpointing: bool = False
    lr_warmup_steps: int = 0

    @classmethod
    def from_node(cls, node, ctx) -> "TrainSettings":
        a = node.attrs
        gen = ctx.generator()
        return cls(model_folder=ctx.folders[node.model], algorithm=a["algorithm"], loss=dict(a["loss"]),
                   lr=a["lr"], weight_decay=a["weight_decay"], max_grad_norm=a["max_grad_norm"], micro_batch_size=1,
                   temperature=gen.attrs.get("temperature") or 1.0, seed=ctx.seed,
                   max_tokens_per_micro_batch=a.get("max_tokens_per_micro_batch", 0),
                   pack_sequences=a.get("pack_sequences", False), shared_prefix=a.get("shared_prefix", False),
                   user_algorithm=ctx.plan.algorithms.get(a["algorithm"]), micro_batches=node.micro_batches or 1,
                   activation_checkpointing=node.activation_checkpointing,
                   lr_warmup_steps=a.get("lr_warmup_steps", 0))

    def lr_at(self, step: int) -> float:
        """AdamW's learning rate at train step ``step`` (0-based; ``lr_schedule.warmup_lr``)."""
        return warmup_lr(self.lr, self.lr_warmup_steps, step)

    def loss_config(self) -> LossConfig:
        """The plan's loss config of this node."""
        return LossConfig(**self.loss)

    def build_algorithm(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> BaseAlgorithm:
        """This node's algorithm over ``model`` and ``optimizer``, with the plan's loss config."""
        cls = decode_value(self.user_algorithm) if self.user_algorithm is not None else get_algorithm(self.algorithm)
        return cls(self.loss_config(), model, optimizer, micro_batch_size=self.micro_batch_size,
                   max_grad_norm=self.max_grad_norm, temperature=self.temperature,
                   max_tokens_per_micro_batch=self.max_tokens_per_micro_batch, pack_sequences=self.pack_sequences,
                   shared_prefix=self.shared_prefix)


def micro_batch_size(rows: int, dp: int, micro_batches: int) -> int:
    """Sequences per micro-batch: the rank's ``rows / dp`` in ``micro_batches`` parts (ceil)."""
    return max(1, math.ceil(rows / dp / max(1, micro_batches)))
