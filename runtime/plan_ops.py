"""The user ops a plan carries by value, registered in the process that runs them.

Owns :func:`register_plan_ops`: a graph file's ``@register_op`` kinds travel in ``plan.ops``
(cloudpickled), so a worker (or the driver's checks) can build their executors without the
graph file.
"""

from __future__ import annotations

from areal_flow.ops.registry import define
from compiler.plan import Plan, decode_value


def register_plan_ops(plan: Plan) -> None:
    """Register the user ops the plan carries (so their executors can be built here)."""
    for encoded in plan.ops.values():
        define(decode_value(encoded))
