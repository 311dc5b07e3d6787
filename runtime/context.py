"""What a worker knows while it runs its nodes: the plan, the model folders, its models.

Owns :class:`WorkerContext`, handed to every op executor (``areal_flow.ops.registry``):
it loads each model the worker's nodes read or train once, from the folder the driver
prepared (``runtime.models.prepare_models``), with the head the plan names (``lm``: a
causal LM; ``value``: the PPO critic, ``areal_flow.models.critic``; ``reward``: a reward
model, ``areal_flow.models.reward_model``). It must not schedule anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from compiler.plan import NodePlan, Plan

@dataclass
class WorkerContext:
    """One worker's view of the run.

    Attributes:
        plan: the plan being executed.
        folders: model name -> folder of its version-0 weights.
        out_dir: the run folder.
        rank: this worker's index within its group (generation replica, trainer rank).
        models: loaded models, by name (filled by :meth:`model`).
        rank_trainer: on rank 0 of a multi-rank trainer, the ranks' driver
            (``runtime.parallel_trainer``); None on one process.
    """

    plan: Plan
    folders: dict[str, str]
    out_dir: Path
    rank: int = 0
    threads: int = 1
    cores: object = None  # runtime.core_lending.CoreShare: threads lent among local workers
    models: dict = field(default_factory=dict)
    rank_trainer: object = None
    _tokenizer: object = None
    _dtype: torch.dtype | None = None

    @property
    def seed(self) -> int:
        return int(self.plan.run["seed"])

    @property
    def dtype(self) -> torch.dtype:
        """``model.dtype`` of the run on this worker's device (``auto`` resolved once by
        ``areal_flow.dtypes.model_dtype``): the trainer's autocast dtype and the generation engine's
        source weights' dtype."""
        from areal_flow.dtypes import model_dtype, torch_dtype
        from runtime.engines.precision import autocast_bf16_speedup

        if self._dtype is None:
            self._dtype = torch_dtype(model_dtype(self.plan.run.get("dtype", "float32"), self.plan.device_type,
                                                  bf16_speedup=autocast_bf16_speedup))
        return self._dtype

    @property
    def tokenizer(self):
        """The policy's tokenizer (every model of a run shares the policy's vocabulary)."""
        if self._tokenizer is None:
            from areal_flow.models.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.folders[self.policy_name()])
        return self._tokenizer

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def policy_name(self) -> str:
        """The model of the generator (the ``stream`` node: generate or rollout)."""
        return self.generator().model

    def generator(self) -> NodePlan:
        """The plan's generator node (grain ``stream``)."""
        return next(n for n in self.plan.nodes if n.grain == "stream")

    def node(self, name: str) -> NodePlan:
        return self.plan.node(name)

    def model(self, name: str) -> torch.nn.Module:
        """The model ``name`` (loaded once per worker; frozen ones in eval mode, no grad).

        Raises:
            KeyError: the plan has no such model.
        """
        if name not in self.models:
            info = self.plan.models[name]
            folder = self.folders[name]
            written = self.plan.device_type == "cpu" and info["trainable"]  # out of the file's mapping now
            if info["head"] == "value":
                from areal_flow.models.critic import ValueModel

                model = ValueModel.from_policy(folder, seed=self.seed, in_memory=written)
            elif info["head"] == "reward":
                from areal_flow.models.reward_model import RewardModel

                model = RewardModel.load(folder)
            else:
                from runtime.model_source import load_pretrained

                model, _ = load_pretrained(folder, in_memory=written)
            if not info["trainable"]:
                model.eval().requires_grad_(False)
            self.models[name] = model
        return self.models[name]
