"""The user code a plan carries by value, registered in the process that runs it.

Owns :func:`register_plan_ops`: a graph file's ``@register_op`` kinds (``plan.ops``),
``@register_algorithm`` classes (``plan.algorithms``) and ``@register_estimator`` functions
(``plan.estimators``) travel cloudpickled, so a worker (or the driver's checks, or a replay)
can build their executors, algorithms and advantages without the graph file.
"""

from __future__ import annotations

from areal_flow.algorithms.catalog import add_user_estimator
from areal_flow.ops.registry import define
from compiler.plan import Plan, decode_value


def register_plan_ops(plan: Plan) -> None:
    """Register the user ops, algorithms and estimators the plan carries (module doc)."""
    for encoded in plan.ops.values():
        define(decode_value(encoded))
    if plan.algorithms:
        from areal_flow.algorithms.registry import register_algorithm

        for name, encoded in plan.algorithms.items():
            register_algorithm(name)(decode_value(encoded))
    for name, encoded in plan.estimators.items():
        add_user_estimator(name, decode_value(encoded))
