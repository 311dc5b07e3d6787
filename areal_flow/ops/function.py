"""The worker side of a user op: call its function, check what it returns against its ports.

Owns :class:`FunctionExecutor`, the executor of every op a graph file registers with
``register_op``. The function gets its input ports' values (``areal_flow.values``) and the
node's attributes as keyword arguments; what it returns is read by one rule:

* an op with one output port returns that port's value;
* an op with several returns a mapping whose keys are exactly its output port names;
* a ``group`` op returns None to drop the group (its batch slot is resampled).

Each value is then checked against its port's type where the function returns
(``areal_flow.values.port_value``): its class, and for a per-sample type one entry per
trajectory of the group (a ``batch`` op: a list of one such value per group of the step).
A value that fails stops the run with one line naming the op, the node, the port, the group
(admission index) and what came back. A plain list of floats for a ``rewards`` port (a list
of trajectories for ``rollouts``, ...) becomes the port's class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from areal_flow.ops.registry import BATCH, GROUP, lookup
from areal_flow.values import PER_SAMPLE, PER_STEP, PortValueError, describe, port_value


class FunctionExecutor:
    """Runs a user op's function: ``fn(**inputs, **attrs)`` (module doc).

    ``info`` (from the worker): ``index`` (a group op: the group's admission index) or
    ``indices`` (a batch op: the step's, in order), and ``samples``: the trajectories of the
    group (an int) or of each group of the step (a list); without ``samples`` (a replay of a
    record) counts are not checked, classes are.
    """

    def __init__(self, fn: Callable, node, ctx) -> None:
        self.fn, self.node = fn, node
        self.grain = lookup(node.op).grain
        self.types = {p.name: p.type for p in lookup(node.op).spec.outputs}

    def _where(self) -> str:
        return f"op '{self.node.op}' (node '{self.node.name}', {self.node.source})"

    def run(self, inputs: dict, info: dict) -> dict | None:
        """Raises PortValueError: a result that breaks the module's rule or its ports' types."""
        result = self.fn(**inputs, **self.node.attrs)
        if result is None:
            if self.grain == GROUP:
                return None
            raise PortValueError(f"{self._where()} returned None; a batch op returns its output "
                                 f"{', '.join(self.types)} (only a group op may drop its group)")
        if len(self.types) == 1:
            ports = {next(iter(self.types)): result}
        elif not isinstance(result, Mapping) or set(result) != set(self.types):
            raise PortValueError(f"{self._where()} returned {describe(result)}; an op with outputs "
                                 f"{', '.join(self.types)} returns a mapping with exactly those keys")
        else:
            ports = dict(result)
        return {port: self._checked(port, value, info) for port, value in ports.items()}

    def _checked(self, port: str, value: Any, info: dict) -> Any:
        kind, samples = self.types[port], info.get("samples")
        what = f"{self._where()}: port '{port}' ({kind})"
        if self.grain == BATCH and kind in PER_SAMPLE:
            return self._per_group(what, kind, value, info)
        if self.grain == BATCH and kind in PER_STEP and samples is not None:
            samples = sum(samples)
        where = f", group {info['index']} (admission index)" if self.grain == GROUP and "index" in info else ""
        try:
            return port_value(kind, value, samples if kind in (*PER_SAMPLE, *PER_STEP) else None)
        except PortValueError as exc:
            raise PortValueError(f"{what}{where}: {exc}") from None

    def _per_group(self, what: str, kind: str, value: Any, info: dict) -> list:
        """A batch op's per-sample port: one value per group of the step, each checked."""
        samples, indices = info.get("samples"), info.get("indices")
        if not isinstance(value, (list, tuple)):
            raise PortValueError(f"{what}: got {describe(value)}; a batch op returns a list of one value per group "
                                 "of the step")
        if samples is not None and len(value) != len(samples):
            raise PortValueError(f"{what}: {len(value)} groups for a step of {len(samples)}")
        out = []
        for j, group in enumerate(value):
            try:
                out.append(port_value(kind, group, None if samples is None else samples[j]))
            except PortValueError as exc:
                group = f"group {j} of the step" if indices is None else f"group {indices[j]} (admission index)"
                raise PortValueError(f"{what}, {group}: {exc}") from None
        return out
