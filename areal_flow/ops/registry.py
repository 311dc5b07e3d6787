"""The op registry: what every node kind is, for the tracer, the compiler and the runtime.

Owns :class:`OpDef`, the one record of a node kind: its port schema (tracing and
validation), its compiler role (the cost hook: which device work it is), its *grain*
(how the runtime feeds it) and its executor (what a worker calls). Built-in ops register
themselves in their own module (``areal_flow/ops/<op>.py``); a user registers a new op
from a graph file with :func:`register_op`, and the runtime runs it with no edit to
``runtime/``. It imports no torch: executors are named ``"module:Class"`` and imported
by the worker that runs them.

Grains (how a worker drives a node):

* ``source`` (``dataset``): yields one prompt per admitted batch slot; runs on the router.
* ``stream`` (``generate``): an engine that takes prompt groups and returns finished ones
  at its own pace (continuous batching), on a generation replica; one fed by a ``group``
  node instead of the dataset (a frozen LLM judge) runs per group in the worker that hosts
  it (``runtime.executors.fed_generate``).
* ``group``: a function of one prompt group's values (reward, filter, logprobs, user ops),
  run as each group arrives on the worker that hosts it.
* ``batch``: a function of the ``B`` groups of one train step, in admission order
  (advantage, train_step), on the worker that hosts it.
* ``route``: no executor; the compiler lowers it to weight routes (sync_weights).

What the runtime does with a node follows from its op's declarations, never its name: the
grain; the role (``training``: the node trains its model, the model's one trainer, a
``batch`` node whose one data input is the step's batch, whatever the port is called); a
``stream`` op's ``multi_turn`` (its rollouts are episodes); a ``group`` op's
``max_attempts`` (it may drop a group, and allows that many prompts per batch slot). The
compiler copies them into the plan's nodes (``NodePlan.role``, ``multi_turn``,
``max_attempts``), which is what the runtime reads.

Executor protocol (worker side, declared in :mod:`areal_flow.ops.interfaces`):
``Executor(node, ctx)`` with ``node`` the plan's :class:`~compiler.plan.NodePlan` and
``ctx`` the worker's :class:`runtime.context.WorkerContext`; ``executor.run(inputs, info)
-> dict`` maps the node's input ports to values (classes of ``areal_flow.values``; for a
``batch`` node, a port fed by ``group`` nodes gets the list of the step's per-group values) and returns the output
ports' values; a ``group`` executor returns ``None`` to drop the group (its batch slot is
then resampled). A ``stream`` executor is driven by a generation replica instead
(``StreamExecutor``), a trainer's executor also checkpoints and publishes (``Trainer``).
A user op's function runs in ``areal_flow.ops.function``, which checks its result against
its ports.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from areal_flow.graph import DATA, GraphError, OpSpec, PortSpec

SOURCE, STREAM, GROUP, BATCH, ROUTE = "source", "stream", "group", "batch", "route"
GRAINS = (SOURCE, STREAM, GROUP, BATCH, ROUTE)
GENERATION, TRAINING, INFERENCE, CPU = "generation", "training", "inference", "cpu"
ROLES = (GENERATION, TRAINING, INFERENCE, CPU)


@dataclass(frozen=True)
class OpDef:
    """One node kind.

    Attributes:
        spec: port schema.
        grain: one of :data:`GRAINS` (module doc).
        role: compiler role of its nodes (:data:`ROLES`), or ``role(node) -> str`` when it
            depends on the node (a reward node with a model is ``inference``).
            ``training`` says a node of it trains its model (``spec.trains``; grain ``batch``).
        executor: ``"module:attr"`` of the executor class (built-ins, imported by the worker),
            or the class / function itself (user ops; sent to workers by value).
        builtin: shipped with areal-flow (the plan names it); False: the plan carries it.
        multi_turn: a ``stream`` op whose rollouts are multi-turn episodes against an env
            (``rollout``): evaluated by playing episodes, bounded by the episode's context.
        max_attempts: a ``group`` op that may drop its group (``filter``): ``max_attempts(node)
            -> int``, the prompts a node of it allows per batch slot (the first + replacements).
    """

    spec: OpSpec
    grain: str
    role: str | Callable[[Any], str] = CPU
    executor: str | Callable | None = None
    builtin: bool = True
    multi_turn: bool = False
    max_attempts: Callable[[Any], int] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def role_of(self, node) -> str:
        """The compiler role of ``node`` (a graph node of this op)."""
        return self.role(node) if callable(self.role) else self.role

    def max_attempts_of(self, node) -> int | None:
        """Prompts per batch slot ``node`` allows, if its op may drop a group; else None."""
        return None if self.max_attempts is None else int(self.max_attempts(node))

    def load_executor(self) -> Callable:
        """The executor class/function (imports a built-in's module). Raises GraphError if missing."""
        if self.executor is None:
            raise GraphError(f"op '{self.name}' has no executor (grain {self.grain})")
        if not isinstance(self.executor, str):
            return self.executor
        module, _, attr = self.executor.partition(":")
        return getattr(importlib.import_module(module), attr)


OPS: dict[str, OpDef] = {}


def define(op: OpDef) -> OpDef:
    """Add ``op`` to the registry (same name again replaces it: re-importing a graph file).

    Raises:
        GraphError: an unknown grain or role, a name that shadows a built-in op, or
            declarations that disagree: role ``training`` without ``spec.trains`` (or the
            reverse), a trainer that is not a ``batch`` op with a model, ``multi_turn`` on a
            non-``stream`` op, ``max_attempts`` on a non-``group`` op; a trainer without exactly
            one data input or without the outputs ``stats`` and ``weights``.
    """
    if op.grain not in GRAINS:
        raise GraphError(f"op '{op.name}': grain {op.grain!r}; expected one of {', '.join(GRAINS)}")
    if not callable(op.role) and op.role not in ROLES:
        raise GraphError(f"op '{op.name}': role {op.role!r}; expected one of {', '.join(ROLES)}")
    for bad, rule in (((op.role == TRAINING) != op.spec.trains, "role 'training' and spec.trains go together"),
                      (op.spec.trains and (op.grain != BATCH or not op.spec.needs_model),
                       "an op that trains its model has grain 'batch' and needs a model"),
                      (op.spec.trains and len([p for p in op.spec.inputs if p.kind == DATA]) != 1,
                       "an op that trains its model takes the step's batch on one data input port"),
                      (op.spec.trains and not {"stats", "weights"} <= {p.name for p in op.spec.outputs},
                       "an op that trains its model has outputs 'stats' and 'weights'"),
                      (op.multi_turn and op.grain != STREAM, "multi_turn is for 'stream' ops"),
                      (op.max_attempts is not None and op.grain != GROUP, "max_attempts is for 'group' ops")):
        if bad:
            raise GraphError(f"op '{op.name}': {rule}")
    known = OPS.get(op.name)
    if known is not None and known.builtin and not op.builtin:
        raise GraphError(f"op '{op.name}' is a built-in op; register yours under another name")
    OPS[op.name] = op
    return op


def op_specs() -> dict[str, OpSpec]:
    """Name -> port schema of every registered op (what the graph validator reads)."""
    return {name: op.spec for name, op in OPS.items()}


def lookup(name: str) -> OpDef:
    """The op called ``name``. Raises GraphError naming the nearest registered op."""
    op = OPS.get(name)
    if op is None:
        near = difflib.get_close_matches(name, list(OPS), n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise GraphError(f"unknown op '{name}'{hint} (registered: {', '.join(sorted(OPS))})")
    return op


def check_arguments(where: str, given: Iterable[str], accepted: Iterable[str], *, taker: str,
                    nearby: Iterable[str] = ()) -> None:
    """Reject keyword arguments of an op call that nothing downstream takes (a typo).

    Ops that forward free keyword arguments (an advantage estimator's knobs, a user op's
    function parameters, a dataset's config keys) check them here while the graph is
    traced, so a typo fails before anything is written instead of inside a worker; every
    built-in op function checks its own keywords here too (:func:`op_function`).

    Args:
        where: the culprit and its graph file:line (a node's ``where()``).
        given: the keyword names the call passed.
        accepted: the names ``taker`` takes.
        taker: what takes them, for the message (``"estimator 'grpo'"``).
        nearby: other valid names of the call (the op's own parameters), offered as a
            did-you-mean but not accepted here (``estimatr`` -> ``estimator``).

    Raises:
        GraphError: one line: ``where`` (node or op, graph file:line), the unknown
            argument, the nearest valid name and what ``taker`` takes.
    """
    accepted = list(accepted)
    for arg in given:
        if arg in accepted:
            continue
        near = difflib.get_close_matches(arg, [*accepted, *nearby], n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        takes = ", ".join(accepted) if accepted else "no extra arguments"
        raise GraphError(f"{where}: unknown argument '{arg}'; {hint}{taker} takes: {takes}")


def function_parameters(fn: Callable, skip: Iterable[str] = ()) -> list[str] | None:
    """Keyword-passable parameter names of ``fn`` minus ``skip``; None if it takes ``**kwargs``."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    skip, by_position = set(skip), (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY)
    return [p.name for p in params if p.kind not in by_position and p.name not in skip]


FUNCTIONS: dict[str, Callable] = {}
"""Built-in op name -> its ``ops.<name>`` function (:func:`op_function` records it)."""


def argument_types(op: str) -> dict[str, Any]:
    """Keyword argument -> annotation of built-in op ``op``'s function, e.g. ``{"n_samples": int,
    ...}`` for ``generate`` (what a plan's node attribute of that name is checked against);
    ``name`` (the node's) left out; empty for a user op."""
    fn = FUNCTIONS.get(op)
    hints = {} if fn is None else typing.get_type_hints(fn)
    return {k: v for k, v in hints.items() if k not in ("name", "return")}


def op_function(fn: Callable) -> Callable:
    """Decorator of a built-in ``ops.<name>`` function: a keyword argument it does not take
    raises :class:`GraphError` through :func:`check_arguments` (``ops.generate
    (graphs/x.py:12): unknown argument 'n_sample'; did you mean 'n_samples'? ...``) rather
    than a bare ``TypeError``. Keywords of a function with ``**kwargs`` are its own to check."""
    from areal_flow.tracing import user_source

    takes = function_parameters(fn)
    FUNCTIONS[fn.__name__] = fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if takes is not None and any(k not in takes for k in kwargs):
            check_arguments(f"ops.{fn.__name__} ({user_source()})", kwargs, takes, taker=f"ops.{fn.__name__}")
        return fn(*args, **kwargs)

    return call


class UserOp:
    """A user-registered op: call it inside a ``@flow`` to record a node.

    ``op(handle, ..., name=None, model=None, **attrs)``: positional handles fill the input
    ports in declaration order (or pass them by port name); ``attrs`` are the node's
    attributes, given to the function on the worker; a trainer (role ``training``) takes
    ``max_staleness=k``, the bound on its data edge, as ``ops.train_step`` does. Returns the handle of the first
    output port (a tuple of handles when there are several). Raises GraphError for an
    attribute the function does not take (unless it takes ``**kwargs``).
    """

    def __init__(self, op: OpDef, fn: Callable) -> None:
        self.op, self.fn = op, fn
        self.__doc__ = fn.__doc__
        self.__name__ = op.name

    def __call__(self, *handles, name: str | None = None, model=None, **kwargs):
        from areal_flow.tracing import Handle, record

        ports = [p.name for p in self.op.spec.inputs]
        if len(handles) > len(ports):
            raise GraphError(f"op '{self.op.name}' takes {len(ports)} inputs ({', '.join(ports)}), got {len(handles)}")
        inputs = dict(zip(ports, handles))
        inputs.update({k: kwargs.pop(k) for k in list(kwargs) if k in ports})
        staleness = None
        if self.op.spec.trains and "max_staleness" in kwargs:  # a trainer's k, on its data edge (as train_step's)
            staleness = dict.fromkeys(ports, kwargs.pop("max_staleness"))
        attrs = kwargs if self.op.executor is self.fn else {**_defaults(self.fn, skip=ports), **kwargs}
        node = record(self.op.spec, inputs, model=model, attrs=attrs, name=name, staleness=staleness)
        takes = function_parameters(self.fn, skip=ports)
        if takes is not None:
            check_arguments(node.where(), kwargs, takes, taker=f"op '{self.op.name}' (function {self.fn.__name__})",
                            nearby=[*ports, "name", "model"])
        outs = tuple(Handle(node.name, p.name, p.type) for p in self.op.spec.outputs)
        return outs[0] if len(outs) == 1 else outs


def _defaults(fn: Callable, skip: Iterable[str]) -> dict:
    """The keyword parameters of ``fn`` that have defaults, minus ``skip``: the attributes of a
    node whose op runs a declared executor instead of ``fn`` (which reads them from the node)."""
    return {p.name: p.default for p in inspect.signature(fn).parameters.values()
            if p.default is not inspect.Parameter.empty and p.name not in skip}


def register_op(
    name: str,
    *,
    inputs: dict[str, str],
    outputs: dict[str, str],
    grain: str = GROUP,
    role: str = CPU,
    needs_model: bool = False,
    executor: str | None = None,
) -> Callable[[Callable], UserOp]:
    """Decorator: register the function as a new node kind (a graph file may use it).

    Args:
        name: the op name (must not shadow a built-in).
        inputs / outputs: port name -> value type (``prompts``, ``rollouts``, ``rewards``,
            ``logprobs``, ``advantages``, ``stats``, ``weights``: the classes of
            ``areal_flow.values``, or a new type name); every input is required.
        grain: ``group`` (called once per prompt group) or ``batch`` (once per train step,
            with lists of the step's per-group values).
        role: compiler role; ``cpu`` for light functions (placed with their consumer);
            ``training``: a node of it trains its ``model=`` (the model's one trainer: grain
            ``batch``, one data input, outputs ``stats`` and ``weights``; implies ``needs_model``).
        executor: ``"module:Class"`` of an executor to run instead of the function, e.g. the
            built-in trainer ``"runtime.executors.train:TrainStepExecutor"``; the function then
            only declares the node's attributes (its keyword parameters, defaults included).

    The function gets its inputs as ``areal_flow.values`` classes and returns the value of
    its one output port, or a mapping whose keys are exactly its output ports, or (a group
    op) None to drop the group; the result is checked against the ports' types and, per
    sample, the group's length (``areal_flow.ops.function``). A list of floats for
    ``rewards`` is fine, as in the example.

    Example::

        @register_op("length_penalty", inputs={"rollouts": "rollouts", "rewards": "rewards"},
                     outputs={"rewards": "rewards"})
        def length_penalty(rollouts, rewards, coef=0.01):
            return [r - coef * len(t.output_ids) for t, r in zip(rollouts, rewards)]

    Raises:
        GraphError: a bad grain or role (a trainer whose grain is not ``batch``), or a built-in's name.
    """
    if grain not in (GROUP, BATCH):
        raise GraphError(f"register_op('{name}'): user ops have grain 'group' or 'batch', got {grain!r}")
    trains = role == TRAINING

    def wrap(fn: Callable) -> UserOp:
        spec = OpSpec(name, tuple(PortSpec(p, t) for p, t in inputs.items()),
                      tuple(PortSpec(p, t) for p, t in outputs.items()), needs_model=needs_model or trains,
                      trains=trains)
        op = define(OpDef(spec, grain, role, executor or fn, builtin=False))
        return UserOp(op, fn)

    return wrap
