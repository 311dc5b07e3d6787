"""areal-flow: asynchronous RL for language models as a dataflow graph compiled from a Python DSL.

Public API: ``flow`` (decorator), ``Model``, ``ops`` (the node kinds). Configs are in
``areal_flow.config`` (loaded by ``areal_flow.config_load``); the command line is ``areal_flow.cli``
(``areal-flow``). The names load their module on first use, so importing a submodule (the
runtime reading a plan) does not import the DSL.
"""

from areal_flow.lazy import lazy_getattr

_EXPORTS = {"Flow": "areal_flow.dsl", "Handle": "areal_flow.tracing", "Model": "areal_flow.tracing",
            "flow": "areal_flow.dsl", "ops": "areal_flow.ops"}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

__getattr__ = lazy_getattr("areal_flow", _EXPORTS)
