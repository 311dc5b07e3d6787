"""The Ray cluster side of ``scheduler.type=ray``: connect, check the cluster against the
plan, and turn the plan's device meshes into placement groups.

Owns the connection (``scheduler.address``, else ``RAY_ADDRESS``, else a new local
cluster; graph files' modules pickled by value over it), the inventory check (before any
model is touched), and one placement group per distinct device mesh of the plan, each
bundle pinned to the Ray node that stands for the plan's machine. It must not run workers (``runtime.ray_scheduler``) nor decide placement
(``compiler``).

Devices: one plan device is one unit of a Ray resource, ``scheduler.device_resource``
(default ``GPU``, or ``CPU`` for ``cluster.gpu=cpu``). Plan machine ``i`` is the ``i``-th
alive Ray node offering ``cluster.n_gpus_per_node`` of it (the head node first, then by
node id). A mesh becomes a placement group with one bundle per machine it spans, holding
its devices on that machine (plus one CPU when devices are not CPUs). A machine whose node
dies mid-run is stood for by a spare alive node (:func:`lost_machines`, :func:`spare_nodes`).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

import cloudpickle
import ray
import ray.cloudpickle
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from areal_flow.config import ConfigError, ExperimentConfig
from compiler.mesh import MeshSpec

NODE_ID_LABEL = "ray.io/node-id"  # the label Ray sets on every node; pins a bundle to one node
HEAD_RESOURCE = "node:__internal_head__"


class RayClusterUnreachable(ConfigError):
    """No Ray cluster answers at ``scheduler.address`` / ``RAY_ADDRESS`` (named)."""


class ClusterMismatchError(ConfigError):
    """The Ray cluster offers fewer nodes or devices than the plan's ``cluster.*`` keys say."""


class NodeLost(ClusterMismatchError):
    """A Ray node standing for a plan machine died mid-run and no other alive node can take
    its devices (the message names the node and the plan's devices)."""


@dataclass
class Connection:
    """How this driver reached Ray: ``address`` ('' for a cluster started here), whether
    it ``started`` that cluster, whether it ``owns`` the connection (else it reused one)."""

    address: str
    started: bool
    owns: bool

    def close(self) -> None:
        """Disconnect (stopping a cluster started here); a reused connection stays."""
        if self.owns:
            ray.shutdown()


def device_resource(cfg: ExperimentConfig) -> str:
    """The Ray resource one plan device stands for (``scheduler.device_resource``)."""
    return cfg.scheduler.device_resource or ("CPU" if cfg.cluster.gpu.lower() == "cpu" else "GPU")


def _check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Fail fast, naming the address, when nothing listens at ``host:port``."""
    bare = address.removeprefix("ray://")
    if bare == "auto" or ":" not in bare:
        return
    host, _, port = bare.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as exc:
        raise RayClusterUnreachable(
            f"scheduler.address={address!r}: no Ray cluster answers there ({exc}); start one with "
            "`ray start --head` (docs/RAY.md), or leave scheduler.address and RAY_ADDRESS empty to run a local one"
        ) from None


def share_pickle_by_value() -> None:
    """Pickle by value, in Ray too, the modules registered with ``cloudpickle`` for it
    (graph files: ``areal_flow.cli.load_flow``); Ray's vendored cloudpickle has its own registry."""
    for name in cloudpickle.list_registry_pickle_by_value():
        if name in sys.modules:
            ray.cloudpickle.register_pickle_by_value(sys.modules[name])


def connect(cfg: ExperimentConfig) -> Connection:
    """Connect to ``scheduler.address`` (else ``RAY_ADDRESS``), or start a local cluster.

    A driver already connected (``ray.is_initialized()``) is reused as it is. A local
    cluster offers this machine's GPUs and ``max(cores, cluster.n_gpus_per_node)`` logical
    CPUs (so a CPU plan with more devices than cores runs, as on the local scheduler), plus
    ``cluster.n_gpus_per_node`` units of a custom ``scheduler.device_resource``.

    Raises:
        RayClusterUnreachable: nothing answers at the address (checked within 3 s).
    """
    if ray.is_initialized():
        return Connection(address=cfg.scheduler.address, started=False, owns=False)
    address = cfg.scheduler.address or os.environ.get("RAY_ADDRESS", "")
    node_ip = cfg.scheduler.node_ip or None
    common = dict(namespace="areal_flow", include_dashboard=False, _node_ip_address=node_ip,
                  logging_level="WARNING", log_to_driver=True)
    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, **common)
        except ConnectionError as exc:
            raise RayClusterUnreachable(f"scheduler.address={address!r}: {exc}") from None
        return Connection(address=address, started=False, owns=True)
    resource = device_resource(cfg)
    custom = {} if resource in ("CPU", "GPU") else {resource: float(cfg.cluster.n_gpus_per_node)}
    # A cluster started here declares the logical CPUs the plan's devices need (cluster.gpu=cpu):
    # Ray's CPUs are scheduling units, and the local scheduler runs the same plan on fewer cores.
    cpus = max(os.cpu_count() or 1, cfg.cluster.n_gpus_per_node) if resource == "CPU" else None
    ray.init(address="local", resources=custom, num_cpus=cpus, **common)
    return Connection(address="", started=True, owns=True)


def _by_plan_order(cfg: ExperimentConfig) -> tuple[list[dict], list[str]]:
    """The alive Ray nodes (the head first, then by node id) and the ids of those offering
    ``cluster.n_gpus_per_node`` units of the device resource, in that order."""
    resource, need = device_resource(cfg), cfg.cluster.n_gpus_per_node
    alive = [n for n in ray.nodes() if n.get("Alive")]
    alive.sort(key=lambda n: (HEAD_RESOURCE not in n["Resources"], n["NodeID"]))
    return alive, [n["NodeID"] for n in alive if n["Resources"].get(resource, 0.0) >= need]


def plan_nodes(cfg: ExperimentConfig) -> list[str]:
    """Ray node ids standing for the plan's machines ``0 .. cluster.n_nodes - 1``.

    Raises:
        ClusterMismatchError: fewer alive nodes than ``cluster.n_nodes`` offer
            ``cluster.n_gpus_per_node`` units of the device resource (lists what each offers).
    """
    resource, need = device_resource(cfg), cfg.cluster.n_gpus_per_node
    alive, fits = _by_plan_order(cfg)
    if len(fits) < cfg.cluster.n_nodes:
        offered = ", ".join(f"{n['NodeID'][:8]}@{n['NodeManagerAddress']} "
                            f"{resource}={n['Resources'].get(resource, 0.0):g}" for n in alive)
        raise ClusterMismatchError(
            f"the plan needs cluster.n_nodes={cfg.cluster.n_nodes} node(s) with cluster.n_gpus_per_node={need} "
            f"'{resource}' each, but the Ray cluster offers {len(fits)} such node(s) ({offered}); set cluster.* "
            "to what the cluster has, add nodes, or pick the resource with scheduler.device_resource"
        )
    return fits[: cfg.cluster.n_nodes]


def lost_machines(nodes: list[str]) -> dict[int, str]:
    """The plan machines (indices into ``nodes``, the Ray node ids standing for them) whose
    node is no longer alive, each with ``"<node id prefix>@<IP>"``; empty when all are."""
    known = {n["NodeID"]: n for n in ray.nodes()}
    return {i: f"{node[:8]}@{known.get(node, {}).get('NodeManagerAddress', '?')}"
            for i, node in enumerate(nodes) if not known.get(node, {}).get("Alive")}


def spare_nodes(cfg: ExperimentConfig, nodes: list[str]) -> list[str]:
    """Alive nodes offering ``cluster.n_gpus_per_node`` devices that stand for no plan
    machine yet (not in ``nodes``), in plan order (:func:`plan_nodes`)."""
    return [n for n in _by_plan_order(cfg)[1] if n not in nodes]


def mesh_bundles(mesh: MeshSpec, resource: str, share_cpu: bool) -> list[dict[str, float]]:
    """One bundle per machine of ``mesh``: its ``n_devices`` units of ``resource`` (+1 CPU
    when ``share_cpu``, i.e. the devices are not CPUs and the actor needs a core)."""
    bundle = {resource: float(mesh.n_devices)}
    if share_cpu:
        bundle["CPU"] = 1.0
    return [dict(bundle) for _ in range(mesh.n_nodes)]


def create_placement_group(mesh: MeshSpec, nodes: list[str], resource: str, name: str,
                           timeout_s: float) -> PlacementGroup:
    """A placement group for ``mesh``, bundle ``j`` pinned to Ray node ``nodes[mesh.first_node + j]``.

    Raises:
        ClusterMismatchError: not placed within ``timeout_s`` seconds (the resources are
            taken by other jobs); the group is removed.
    """
    bundles = mesh_bundles(mesh, resource, share_cpu=resource != "CPU")
    selectors = [{NODE_ID_LABEL: nodes[mesh.first_node + j]} for j in range(mesh.n_nodes)]
    pg = placement_group(bundles, strategy="PACK", name=name, bundle_label_selector=selectors)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise ClusterMismatchError(
            f"placement group {name!r} (mesh {mesh.label()}, bundles {bundles}) was not placed within "
            f"{timeout_s:g} s (scheduler.placement_timeout_s): are other jobs holding the resources?"
        )
    return pg
