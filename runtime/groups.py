"""One prompt group travelling through the graph: its values, the ``group``-grain nodes run
on it, the removal of its failed samples, and its filing for a train step.

Owns :class:`GroupItem` and what every worker does with one (``runtime.workers`` drives it):

* :func:`run_group_nodes` runs the group nodes placed on a worker, in graph order;
* :func:`drop_failed_samples`: a sample whose reward failed (``meta["reward_failed"]``, set
  by the ``reward`` op: raised, timed out or non-finite, ``areal_flow.rewards.pool``)
  takes no part in its group's statistics (the group-relative baseline, the filter's
  spread) nor in the loss: after each group node it is removed from every per-sample
  value (``areal_flow.values``: rollouts, rewards, logprobs hold one entry per trajectory,
  in the group's order). A group left with no sample is dropped and its slot resampled,
  as after a filter;
* :func:`file_group`: the trainer holds a group for its step, dropping late duplicates.

Must not: decide what failed (the ops do) or schedule anything.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from areal_flow.values import Logprobs, Rewards, Rollouts
from compiler.plan import Plan
from runtime.staleness import OrderedExperienceBuffer
from runtime.trace import TraceRecorder, now_us


@dataclass
class GroupItem:
    """One prompt group travelling through the graph: its admission ``index``, the
    ``attempt``-th prompt of that slot, and the values produced so far (``"node.port"``);
    ``origin`` / ``sent_us``: the worker group that sent it and when (``runtime.trace.now_us``),
    set just before each send (the receiver times the group's wait on the channel)."""

    index: int
    attempt: int
    values: dict = field(default_factory=dict)
    origin: str = ""
    sent_us: int = 0

    def stamp(self, origin: str) -> "GroupItem":
        """Mark the item as sent now by worker group ``origin``."""
        self.origin, self.sent_us = origin, now_us()
        return self

    def rollouts(self, plan: Plan) -> Rollouts:
        """The group's trajectories: the value of the plan's generator (``stream`` node)."""
        gen = next(n for n in plan.nodes if n.grain == "stream")
        return self.values[f"{gen.name}.rollouts"]


def group_size(values: dict) -> int:
    """The trajectories of one group's ``values`` (every per-sample value holds that many)."""
    return next((len(v) for v in values.values() if isinstance(v, Rollouts)), 0)


def _inputs(node, values: dict) -> dict:
    return {port: values[f"{src}.{src_port}"] for port, (src, src_port) in node.inputs.items()}


def run_group_nodes(item: GroupItem, nodes: list, executors: dict, trace: TraceRecorder | None = None) -> bool:
    """Run ``nodes`` (group grain, in order) on ``item``, removing failed samples after each
    (:func:`drop_failed_samples`); False when one dropped the group or no sample is left.
    Each node's run is a span of ``trace`` (track ``groups``); it gets ``info`` = the group's
    ``index``, ``attempt`` and ``samples`` (its trajectories, what a per-sample value must hold)."""
    for node in nodes:
        info = {"index": item.index, "attempt": item.attempt, "samples": group_size(item.values)}
        with trace.span(node.name, "groups", index=item.index, attempt=item.attempt) if trace else \
                contextlib.nullcontext():
            out = executors[node.name].run(_inputs(node, item.values), info)
        if out is None:
            return False
        item.values.update({f"{node.name}.{port}": v for port, v in out.items()})
        if drop_failed_samples(item.values) and not group_size(item.values):
            return False
    return True


def drop_failed_samples(values: dict) -> int:
    """Remove the failed samples from every per-sample value in ``values`` (``"node.port"`` ->
    value, one group; ``areal_flow.values``: ``Rollouts``, ``Rewards``, ``Logprobs``); return
    how many were removed.

    The survivors carry ``meta["reward_failures"]``, the group's count so far, so a train
    step can report failures of the groups it trained (``runtime.observe``).
    """
    group = next((v for v in values.values() if isinstance(v, Rollouts)), None)
    if group is None:
        return 0
    keep = [i for i, t in enumerate(group) if not t.meta.get("reward_failed")]
    removed = len(group) - len(keep)
    if not removed:
        return 0
    for key, value in values.items():
        if isinstance(value, (Rollouts, Rewards, Logprobs)):
            values[key] = value.select(keep)
    for i in keep:
        group[i].meta["reward_failures"] = group[i].meta.get("reward_failures", 0) + removed
    return removed


def file_group(item: GroupItem, items: dict, buffer: OrderedExperienceBuffer, counts: dict, plan: Plan) -> bool:
    """Hold ``item`` for its train step (``items`` by index, rollouts in ``buffer``); False
    for a late duplicate of a held or trained index (sent twice around a replica restart),
    which is dropped and counted in ``counts["duplicates"]``."""
    if item.index in items or item.index in buffer.consumed_indices:
        counts["duplicates"] += 1
        return False
    items[item.index] = item
    buffer.put(item.index, item.rollouts(plan))
    return True


def failure_counts(executors: dict) -> dict:
    """``{"<node>/failures": {kind: samples}}`` of the nodes that count failed samples (rule rewards)."""
    return {f"{name}/failures": dict(ex.monitor.kinds) for name, ex in executors.items()
            if getattr(ex, "monitor", None) is not None}
