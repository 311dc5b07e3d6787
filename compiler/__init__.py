"""The compiler: graph + cluster + model specs -> :class:`~compiler.plan.Plan`.

Public entry points: :func:`compile_plan`, :func:`format_table`, ``compiler.render.render``,
:func:`check_executable` (what the runtime can run: ``compiler.executable``),
:class:`Plan` (``plan.json``), the configs :class:`ClusterConfig` / :class:`CompileConfig`
and the errors a user can meet. Names load their module on first use, so a reader of plans
(the runtime) imports ``compiler.plan`` without the search.
"""

from areal_flow.lazy import lazy_getattr

_EXPORTS = {
    "AllocationError": "compiler.allocation",
    "ClusterConfig": "areal_flow.config_compile",
    "CompileConfig": "areal_flow.config_compile",
    "CompileConfigError": "areal_flow.config_compile",
    "ExecutableError": "compiler.executable",
    "InfeasiblePlanError": "compiler.errors",
    "MeshSpec": "compiler.mesh",
    "Plan": "compiler.plan",
    "check_executable": "compiler.executable",
    "compile_plan": "compiler.compile",
    "format_table": "compiler.table",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr("compiler", _EXPORTS)
