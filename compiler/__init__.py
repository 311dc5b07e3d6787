"""The compiler: graph + cluster + model specs -> :class:`~compiler.plan.Plan`.

Public entry points: :func:`compile_plan`, :func:`format_table`, ``compiler.viz.render``,
:class:`Plan` (``plan.json``), the configs :class:`ClusterConfig` / :class:`CompileConfig`
and the errors a user can meet.
"""

from compiler.allocation import AllocationError
from compiler.compile import compile_plan
from compiler.config import ClusterConfig, CompileConfig, CompileConfigError
from compiler.errors import InfeasiblePlanError
from compiler.mesh import MeshSpec
from compiler.plan import Plan
from compiler.table import format_table

__all__ = [
    "AllocationError",
    "ClusterConfig",
    "CompileConfig",
    "CompileConfigError",
    "InfeasiblePlanError",
    "MeshSpec",
    "Plan",
    "compile_plan",
    "format_table",
]
