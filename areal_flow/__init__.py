"""areal-flow: asynchronous RL for language models as a dataflow graph compiled from a Python DSL.

Public API: ``flow`` (decorator), ``Model``, ``ops`` (the node kinds). Configs are in
``areal_flow.config`` (loaded by ``areal_flow.config_load``); the command line is ``areal_flow.cli`` (``areal-flow``).
"""

from areal_flow import ops
from areal_flow.dsl import Flow, Handle, Model, flow

__all__ = ["Flow", "Handle", "Model", "flow", "ops"]
__version__ = "0.1.0"
