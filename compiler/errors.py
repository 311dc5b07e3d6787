"""The infeasible-plan error: what does not fit, by how much, and which knob would help.

Owns :class:`InfeasiblePlanError` and the per-node explanation :class:`NodeShortfall`:
for every device node, the smallest memory per device it could reach on this cluster (or
under the manual allocation) against the usable device memory, and the config knob that
attacks the largest component.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_flow.config_compile import CompileConfig
from compiler.cost import WHOLE_COPY_BYTES, NodeCost
from compiler.hardware import GIB
from compiler.workload import GENERATION, DeviceTask


@dataclass(frozen=True)
class NodeShortfall:
    """One node's best reachable memory per device vs the capacity, in bytes.

    Attributes:
        node: graph node name.
        strategy: the strategy (on the largest useful mesh) that reaches ``memory``.
        memory: bytes per device at best, with ``breakdown`` by component.
        capacity: usable bytes per device (memory x memory_fraction).
        knob: the config change most likely to help.
    """

    node: str
    strategy: str
    memory: float
    breakdown: dict
    capacity: float
    knob: str

    @property
    def fits(self) -> bool:
        return self.memory <= self.capacity

    def line(self) -> str:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.breakdown.items() if v)
        verdict = "fits" if self.fits else f"needs {self.memory / GIB:.1f} GiB > {self.capacity / GIB:.1f} GiB"
        return f"  {self.node} ({self.strategy}): {verdict} per device ({parts}); {self.knob}"


class InfeasiblePlanError(ValueError):
    """No allocation fits device memory (or the manual one does not).

    Attributes:
        shortfalls: one :class:`NodeShortfall` per device node.
    """

    def __init__(self, headline: str, shortfalls: list[NodeShortfall]):
        self.shortfalls = shortfalls
        super().__init__("\n".join([headline] + [s.line() for s in shortfalls]))


def knob_for(task: DeviceTask, cost: NodeCost, cfg: CompileConfig) -> str:
    """The config change that attacks the largest memory component of ``cost``."""
    mem = cost.memory
    if cost.fits:
        return "fits alone; the failing combination is elsewhere"
    if task.role == GENERATION:
        if mem.kv_cache > mem.weights:
            return "lower compile.max_prompt_len / max_new_tokens (KV cache of one sequence)"
        return "more devices per machine (tensor parallelism) or a device with more memory (cluster.gpu)"
    if cfg.dtype == "fp32":
        return "set compile.dtype=bf16 (halves weights and activations)"
    states = mem.weights + mem.gradients + mem.optimizer
    if task.critic and cost.strategy.world_size > 1 and 2 * WHOLE_COPY_BYTES * task.model.n_params > states:
        return (f"rank 0 of a multi-rank critic keeps a whole fp32 copy of it ({WHOLE_COPY_BYTES} bytes/param, "
                "runtime.parallel_critic), however many devices: a device with more memory (cluster.gpu) or a "
                "smaller critic model")
    if states >= mem.activations:
        if not cfg.optimizer_sharding and cost.strategy.dp > 1:
            return "set compile.optimizer_sharding=true (ZeRO-3/FSDP shards the 16 bytes/param over DP)"
        return "more devices (cluster.n_nodes) to shard over, or a device with more memory (cluster.gpu)"
    if cfg.activation_checkpointing is False:
        return "set compile.activation_checkpointing=true (keeps 2 of 34 bytes/token/hidden per layer)"
    if cfg.micro_batches is not None:
        return "raise compile.micro_batches (or null to choose) to shrink each micro-batch"
    return "lower compile.max_prompt_len / max_new_tokens (one sequence's activations and logits)"


def shortfall(task: DeviceTask, cost: NodeCost, capacity: float, cfg: CompileConfig) -> NodeShortfall:
    return NodeShortfall(
        node=task.node,
        strategy=cost.strategy.short(),
        memory=cost.memory.total,
        breakdown=cost.memory.to_dict(),
        capacity=capacity,
        knob=knob_for(task, cost, cfg),
    )
