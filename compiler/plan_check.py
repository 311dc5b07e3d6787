"""Consistency of a plan: what a hand edit can break, caught before any process starts, each
error naming the node, edge, route or key. The one check of the parameters the runtime reads.

Owns the structural rules a runnable plan keeps (``Plan.from_dict`` and
``compiler.program.compile_program`` call :func:`check_plan`): node names unique; every
input port names an existing node and one of its output ports; the data edges are exactly
the nodes' input ports (an edge deleted or added by hand would make the drawing and the
program disagree); a node's ``micro_batches`` is null or an int >= 1; every edge's ends exist; a bound ``k`` is an int >= 0 and ``B`` an int
>= 1; every route goes from a train_step to a generator of the same model; two device nodes'
meshes are the same devices (they time-share them) or none in common, and a generator shares
a mesh with another device node exactly when the plan says ``colocated`` (the compiler budgeted
each process's memory so; a mesh moved by hand would have two processes budget one device's
whole memory). A runnable plan
(one with ``run``) also keeps: ``run`` holds what the runtime reads, with ``steps`` and
``seed`` integers; every data edge into a train_step carries k and B, one value of each
(the trainer takes one batch of ``B`` groups per step for all its train_steps); a generator
of a trained model without a route (it samples from version 0 only) is allowed only when
``k >= steps - 1``, else admission would stop after ``k + 1`` steps; every train_step names a
known algorithm (built in, carried in ``plan.algorithms`` or registered here) and its whole
``LossConfig`` (``attrs.loss``); every advantage node a known estimator. Whether an op
exists is the runtime's check (user ops are registered from the plan there:
``runtime.topology``).

It also holds the plan's fields that come from config keys to those keys' types
(:func:`check_config_types`): ``plan.run`` is :class:`compiler.lowering.RunSpec`, so a key
it does not know (``stepz``) is refused with a did-you-mean rather than ignored, and a node
attribute lowered from a config key (``train_step``'s ``lr`` is ``train.lr``, a float) or
named like its built-in op's argument (``generate``'s ``n_samples``, an int) must have that
JSON type; most built-in ops take no other attribute (:data:`CLOSED`). The values
themselves are checked by the config's own checks where a run starts (``runtime.preflight``).
"""

from __future__ import annotations

import difflib

from areal_flow.algorithms.catalog import algorithm_info, estimator_info
from areal_flow.algorithms.config import LossConfig
from areal_flow.graph import staleness_problem
from areal_flow.ops.registry import CPU, GENERATION

RUN_KEYS = ("name", "out_dir", "seed", "steps", "scheduler", "warm_start", "eval")


def check_plan(plan, error) -> None:
    """Raise ``error(message)`` at the first broken rule of the module doc."""
    names = [n.name for n in plan.nodes]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise error(f"plan: two nodes named '{dup}'")
    nodes = {n.name: n for n in plan.nodes}
    for node in plan.nodes:
        m = node.micro_batches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise error(f"plan node '{node.name}': micro_batches={m!r} must be an int >= 1 (micro-batches per DP "
                        "rank) or null")
        for port, source in node.inputs.items():
            if not (isinstance(source, (list, tuple)) and len(source) == 2 and all(isinstance(s, str) for s in source)):
                raise error(f"plan node '{node.name}': input '{port}' must be [node, port], got {source!r}")
            src, src_port = source
            if src not in nodes:
                raise error(f"plan node '{node.name}': input '{port}' comes from '{src}', which is not a node of "
                            "the plan")
            if src_port not in nodes[src].outputs:
                raise error(f"plan node '{node.name}': input '{port}' reads '{src}.{src_port}', but '{src}' has "
                            f"outputs {list(nodes[src].outputs)}")
    wired = {(src, sp, node.name, port) for node in plan.nodes for port, (src, sp) in node.inputs.items()}
    for edge in plan.edges:
        for end in (edge.src, edge.dst):
            if end not in nodes:
                raise error(f"plan edge {edge.src} -> {edge.dst}: '{end}' is not a node of the plan")
        problem = None if edge.max_staleness is None else staleness_problem(edge.max_staleness)
        if problem:
            raise error(f"plan edge {edge.src} -> {edge.dst}: {problem}")
        if edge.batch_groups is not None and (not isinstance(edge.batch_groups, int) or edge.batch_groups < 1):
            raise error(f"plan edge {edge.src} -> {edge.dst}: batch_groups={edge.batch_groups!r} must be an int >= 1")
    drawn = {(e.src, e.src_port, e.dst, e.dst_port) for e in plan.edges if e.kind == "data"}
    for src, sp, dst, port in sorted(wired ^ drawn):
        side = "has no edge" if (src, sp, dst, port) in wired else "has an edge but no input port reads it"
        raise error(f"plan: {src}.{sp} -> {dst}.{port} {side}; edit a node's inputs and its edge together "
                    "(or re-compile)")
    _check_routes(plan, nodes, error)
    _check_meshes(plan, error)
    if plan.run:
        _check_run(plan, error)
        _check_bounds(plan, error)
        _check_unsynced(plan, nodes, error)
        _check_algorithms(plan, error)

    check_config_types(plan, error)


CLOSED = ("dataset", "generate", "reward", "filter", "logprobs", "train_step", "sync_weights")
"""Built-in ops whose node attributes are exactly their function's arguments and lowered config
keys (``rollout`` and ``advantage`` add others: an env's class, an estimator's knobs)."""


def check_config_types(plan, error) -> None:
    """Raise ``error(message)`` at the first ``plan.run`` key that no config key stands for, or
    run value / node attribute whose JSON type is not its config key's or op argument's (module
    doc), e.g. ``plan node 'train_step': lr='fast' is not float (config key train.lr)``."""
    import areal_flow.ops  # noqa: F401  (registers the built-in ops' functions)
    from areal_flow.config_load import key_type
    from areal_flow.ops.registry import argument_types
    from areal_flow.dtypes import DTYPES, ENGINE, wire_dtype_name
    from compiler.lowering import DERIVED, LOWERED, RUN_CONFIG_KEYS
    from compiler.plan_types import fits, type_name

    sections = {k.split(".")[0] for k in RUN_CONFIG_KEYS if "." in k}
    for key, value in plan.run.items():
        if key in sections and not isinstance(value, dict):
            raise error(f"plan.run.{key}={value!r:.60} must be a mapping")
        for dotted, v in ([(f"{key}.{k}", v) for k, v in value.items()] if key in sections else [(key, value)]):
            config_key = RUN_CONFIG_KEYS.get(dotted)
            if config_key is None:
                section, _, leaf = dotted.rpartition(".")
                valid = [k.rpartition(".")[2] for k in RUN_CONFIG_KEYS if k.rpartition(".")[0] == section]
                near = difflib.get_close_matches(leaf, valid + ([] if section else sorted(sections)), n=1)
                hint = f"; did you mean '{near[0]}'?" if near else ""
                raise error(f"plan.run{'.' + section if section else ''}: unknown key '{leaf}'{hint}")
            hint_type = key_type(config_key)
            if not fits(v, hint_type):
                raise error(f"plan.run.{dotted}={v!r:.60} is not {type_name(hint_type)} (config key {config_key})")
    for node in plan.nodes:
        lowered, arguments = LOWERED.get(node.op, {}), argument_types(node.op)
        for attr, value in node.attrs.items():
            if attr in lowered:
                hint_type, via = key_type(lowered[attr]), f"config key {lowered[attr]}"
            elif attr in arguments:
                hint_type, via = arguments[attr], f"an argument of ops.{node.op}"
            elif node.op in CLOSED:
                near = difflib.get_close_matches(attr, [*lowered, *arguments], n=1)
                hint = f"; did you mean '{near[0]}'?" if near else ""
                raise error(f"plan node '{node.name}': unknown attribute '{attr}'{hint}")
            else:
                continue
            if not fits(value, hint_type):
                raise error(f"plan node '{node.name}': {attr}={value!r:.60} is not {type_name(hint_type)} ({via})")
            if attr in DERIVED.get(node.op, ()) and attr.endswith("dtype") and value is not None \
                    and wire_dtype_name(value) is None:
                raise error(f"plan node '{node.name}': {attr}={value!r:.60} is not a dtype "
                            f"(one of {', '.join(DTYPES)}, or {ENGINE})")


def _check_run(plan, error) -> None:
    missing = [k for k in RUN_KEYS if k not in plan.run]
    if missing:
        raise error(f"plan.run lacks {', '.join(missing)} (a plan from 'areal-flow compile' has them)")
    for key in ("steps", "seed"):
        value = plan.run[key]
        if not isinstance(value, int) or isinstance(value, bool) or (key == "steps" and value < 1):
            raise error(f"plan.run.{key}={value!r}: must be an int" + (" >= 1" if key == "steps" else ""))
    if not isinstance(plan.run["scheduler"], dict) or "type" not in plan.run["scheduler"]:
        raise error("plan.run.scheduler must be a mapping with a 'type' (local or ray)")


def _check_meshes(plan, error) -> None:
    """Device nodes' meshes are equal or disjoint; a generator time-shares one iff ``colocated``."""
    placed = [n for n in plan.nodes if n.role != CPU and n.mesh is not None]
    for i, a in enumerate(placed):
        for b in placed[i + 1:]:
            if a.mesh != b.mesh and set(a.mesh.devices()) & set(b.mesh.devices()):
                raise error(f"plan nodes '{a.name}' (mesh {a.mesh.label()}) and '{b.name}' (mesh {b.mesh.label()}) "
                            "overlap: meshes are the same devices (time-shared) or none in common; re-compile "
                            "with compile.allocation")
    shared = next(((g, n) for g in placed if g.role == GENERATION for n in placed
                   if n.role != GENERATION and n.mesh == g.mesh), None)
    if shared is not None and not plan.colocated:
        g, n = shared
        raise error(f"plan nodes '{g.name}' and '{n.name}' share mesh {g.mesh.label()}, but the plan is not colocated "
                    f"(allocation '{plan.allocation}'): the compiler budgeted a device for each; write the allocation "
                    "with '|' (e.g. gen:d1 | train:d1) and compile again")
    if shared is None and plan.colocated and placed:
        raise error(f"plan: colocated is true (allocation '{plan.allocation}'), but no generator shares a mesh with "
                    "another device node; re-compile with compile.allocation")


def _check_bounds(plan, error) -> None:
    """Every data edge into a train_step carries k and B, and they agree (one trainer batch)."""
    edges = plan.train_edges()
    if not edges:
        raise error("plan: no data edge into a train_step (nothing to train)")
    problem = staleness_problem(plan.max_staleness)  # the k the time model assumed (the edges' k runs)
    if problem:
        raise error(f"plan: {problem}")
    for name in ("max_staleness", "batch_groups"):
        for edge in edges:
            if getattr(edge, name) is None:
                what = "k, the staleness bound" if name == "max_staleness" else "B, prompt groups per step"
                raise error(f"plan edge {edge.src} -> {edge.dst}: no {name} ({what}); set it on the edge "
                            "(or re-compile)")
        first = edges[0]
        for edge in edges[1:]:
            if getattr(edge, name) != getattr(first, name):
                raise error(f"plan edge {edge.src} -> {edge.dst}: {name}={getattr(edge, name)}, but "
                            f"{first.src} -> {first.dst} has {getattr(first, name)}; the trainer takes one batch "
                            "for every train_step: give them one value")


def _check_routes(plan, nodes: dict, error) -> None:
    """Each weight route goes from a train_step to a generator (stream node) of its model."""
    for route in plan.routes:
        where = f"plan route {route.src} -> {route.dst}"
        src, dst = nodes.get(route.src), nodes.get(route.dst)
        if src is None or dst is None:
            raise error(f"{where}: '{route.dst if src else route.src}' is not a node of the plan")
        if not src.trains:
            raise error(f"{where}: '{src.name}' is a {src.op}; weights come from a node that trains (a train_step)")
        if dst.grain != "stream":
            raise error(f"{where}: '{dst.name}' is a {dst.op}; weights go to a generator (generate or rollout)")
        if src.model != dst.model:
            raise error(f"{where}: '{src.name}' trains model '{src.model}', but '{dst.name}' samples from "
                        f"'{dst.model}'")
    if len({r.dst for r in plan.routes}) != len(plan.routes):
        dst = next(r.dst for r in plan.routes if [x.dst for x in plan.routes].count(r.dst) > 1)
        raise error(f"plan: two routes send weights to '{dst}'; one route per generator")


def _check_unsynced(plan, nodes: dict, error) -> None:
    """A generator of a trained model with no route samples from version 0: fine only when
    admission never needs a newer version (``k >= steps - 1``)."""
    trained = {n.model: n for n in plan.nodes if n.trains}
    k, steps = plan.staleness_bound, plan.run["steps"]
    for gen in (n for n in plan.nodes if n.grain == "stream"):
        step = trained.get(gen.model)
        if step is not None and not any(r.dst == gen.name for r in plan.routes) and k < steps - 1:
            raise error(f"plan: no route sends '{step.name}''s weights to '{gen.name}', which then samples from "
                        f"version 0 only: admission stops after k + 1 = {k + 1} of {steps} steps; add the route "
                        f"back, or set k >= {steps - 1} on the train_step's data edge")


def _check_algorithms(plan, error) -> None:
    """Known algorithms with a whole, valid loss config; known estimators."""
    for node in plan.nodes:
        if node.trains and "algorithm" in node.attrs:
            name = node.attrs.get("algorithm")
            info = algorithm_info(name) if isinstance(name, str) else None
            if info is None and name not in plan.algorithms:
                raise error(f"plan node '{node.name}': algorithm {name!r} is neither built in nor carried in "
                            "plan.algorithms")
            loss = node.attrs.get("loss")
            if not isinstance(loss, dict):
                raise error(f"plan node '{node.name}': attrs.loss must be the LossConfig mapping, got {loss!r}")
            missing = [f for f in LossConfig.field_names() if f not in loss]
            if missing:
                raise error(f"plan node '{node.name}': attrs.loss lacks {', '.join(missing)} (the plan holds the "
                            "whole loss config; re-compile)")
            try:
                if info is not None:
                    info.loss_config(loss)
                else:
                    LossConfig(**loss)
            except (TypeError, ValueError) as err:
                raise error(f"plan node '{node.name}': attrs.loss: {err}") from None
        elif node.op == "advantage":
            name = node.attrs.get("estimator")
            if not isinstance(name, str) or (estimator_info(name) is None and name not in plan.estimators):
                raise error(f"plan node '{node.name}': estimator {name!r} is neither built in nor carried in "
                            "plan.estimators")
