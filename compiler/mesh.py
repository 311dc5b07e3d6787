"""Device meshes: which devices of which machines a node runs on, and their alignment.

Owns :class:`MeshSpec` (named so as not to clash with ``torch.distributed.DeviceMesh``,
which ``runtime.parallel`` builds from it) and the packing of a list of mesh sizes onto a
cluster. It must not know about models or costs.

Alignment rule: a mesh is either a power-of-two block of 1, 2, 4, 8, ... devices inside
one machine starting at a multiple of its size, or whole consecutive machines. Aligned
meshes keep tensor-parallel groups on NVLink and never straddle a machine boundary.
"""

from __future__ import annotations

from dataclasses import dataclass


class MeshError(ValueError):
    """A mesh breaks the alignment rule or does not fit the cluster."""


@dataclass(frozen=True)
class MeshSpec:
    """A block of devices: machines ``first_node .. first_node+n_nodes-1``, and on each of
    them devices ``first_device .. first_device+n_devices-1``.

    Attributes:
        first_node: index of the first machine.
        n_nodes: number of consecutive machines.
        first_device: index of the first device on each machine.
        n_devices: devices used on each machine.
    """

    first_node: int
    n_nodes: int
    first_device: int
    n_devices: int

    @property
    def size(self) -> int:
        """Devices in the mesh."""
        return self.n_nodes * self.n_devices

    @property
    def spans_nodes(self) -> bool:
        return self.n_nodes > 1

    def devices(self) -> list[tuple[int, int]]:
        """``(machine, device)`` pairs, machine-major."""
        return [
            (node, dev)
            for node in range(self.first_node, self.first_node + self.n_nodes)
            for dev in range(self.first_device, self.first_device + self.n_devices)
        ]

    def label(self) -> str:
        """``n0:g0-3`` (part of one machine) or ``n1-3`` / ``n2`` (whole machines)."""
        last_dev = self.first_device + self.n_devices - 1
        devs = f"g{self.first_device}" if self.n_devices == 1 else f"g{self.first_device}-{last_dev}"
        nodes = f"n{self.first_node}" if self.n_nodes == 1 else f"n{self.first_node}-{self.first_node + self.n_nodes - 1}"
        return nodes if self.n_nodes > 1 else f"{nodes}:{devs}"

    def validate(self, n_nodes: int, devices_per_node: int) -> None:
        """Check the alignment rule against a cluster of ``n_nodes`` x ``devices_per_node``.

        Raises:
            MeshError: naming the mesh and the rule.
        """
        whole = self.first_device == 0 and self.n_devices == devices_per_node
        if self.first_node < 0 or self.n_nodes < 1 or self.first_node + self.n_nodes > n_nodes:
            raise MeshError(f"mesh {self.label()}: machines outside the cluster's {n_nodes}")
        if self.n_nodes > 1 and not whole:
            raise MeshError(f"mesh {self.label()}: a mesh over several machines must use all their devices")
        if not whole:
            size = self.n_devices
            if size & (size - 1) or self.first_device % size or self.first_device + size > devices_per_node:
                raise MeshError(
                    f"mesh {self.label()}: inside a machine a mesh is 1, 2, 4, 8... devices starting "
                    f"at a multiple of its size (machine has {devices_per_node})"
                )

    def to_dict(self) -> dict:
        return dict(first_node=self.first_node, n_nodes=self.n_nodes, first_device=self.first_device, n_devices=self.n_devices)

    @classmethod
    def from_dict(cls, data: dict) -> "MeshSpec":
        return cls(data["first_node"], data["n_nodes"], data["first_device"], data["n_devices"])


def aligned_sizes(n_nodes: int, devices_per_node: int) -> list[int]:
    """Every mesh size the alignment rule allows, ascending (powers of two below a machine,
    then 1..n_nodes whole machines)."""
    sizes = {1 << i for i in range(devices_per_node.bit_length()) if (1 << i) < devices_per_node}
    sizes.update(k * devices_per_node for k in range(1, n_nodes + 1))
    return sorted(sizes)


def pack(sizes: list[int], n_nodes: int, devices_per_node: int) -> list[MeshSpec]:
    """Place meshes of the given sizes first-fit on aligned slots; the meshes come back in the
    order of ``sizes``.

    Sub-machine meshes go into the first machine with a free aligned block (so small meshes
    share a machine and talk over NVLink); larger ones take the first run of free machines.
    The meshes are placed in the order given; when that does not fit, largest first (a small
    mesh placed first can leave no aligned block for a larger one: on a 3-device machine
    ``[1, 2]`` in order puts the 1 at device 0 and finds no aligned pair, largest first
    gives the 2 devices 0-1 and the 1 device 2).

    Raises:
        MeshError: a size is not aligned, or the meshes do not fit the cluster in either order.
    """
    placed = _pack_in_order(sizes, n_nodes, devices_per_node)
    if placed is None:
        order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
        largest_first = _pack_in_order([sizes[i] for i in order], n_nodes, devices_per_node)
        if largest_first is not None:
            placed = [None] * len(sizes)
            for i, mesh in zip(order, largest_first):
                placed[i] = mesh
    if placed is None:
        raise MeshError(
            f"meshes of sizes {sizes} do not fit {n_nodes} machine(s) x {devices_per_node} devices "
            "(sizes must be 1, 2, 4.. inside a machine or whole machines)"
        )
    return placed


def _pack_in_order(sizes: list[int], n_nodes: int, devices_per_node: int) -> list[MeshSpec] | None:
    """First fit of ``sizes`` in the order given, or None when one does not fit."""
    used = [0] * n_nodes  # per machine, a bit mask of taken devices
    meshes = []
    for size in sizes:
        mesh = _first_fit(size, used, devices_per_node)
        if mesh is None:
            return None
        block = ((1 << mesh.n_devices) - 1) << mesh.first_device
        for node in range(mesh.first_node, mesh.first_node + mesh.n_nodes):
            used[node] |= block
        meshes.append(mesh)
    return meshes


def fitting_clusters(sizes: list[int], n_nodes: int, devices_per_node: int) -> tuple[int | None, int | None]:
    """The smallest clusters that hold meshes of ``sizes`` (:func:`pack`) when one dimension of
    ``n_nodes`` x ``devices_per_node`` grows: ``(devices per machine, machines)``, each None
    when no size up to twice the devices asked for fits (e.g. a size that is no power of two)."""
    def fits(nodes: int, per_node: int) -> bool:
        try:
            pack(sizes, nodes, per_node)
        except MeshError:
            return False
        return True

    bound = 2 * sum(sizes)
    per_node = next((d for d in range(devices_per_node + 1, max(bound, devices_per_node) + 1) if fits(n_nodes, d)), None)
    nodes = next((n for n in range(n_nodes + 1, n_nodes + len(sizes) + bound // devices_per_node + 1)
                  if fits(n, devices_per_node)), None)
    return per_node, nodes


def _first_fit(size: int, used: list[int], per_node: int) -> MeshSpec | None:
    if size < per_node:
        if size & (size - 1):
            return None
        block, full = (1 << size) - 1, (1 << per_node) - 1
        for node, mask in enumerate(used):
            if mask == full:
                continue
            for start in range(0, per_node - size + 1, size):
                if not mask & (block << start):
                    return MeshSpec(node, 1, start, size)
        return None
    if size % per_node:
        return None
    need, run = size // per_node, 0
    for node, mask in enumerate(used):
        run = 0 if mask else run + 1
        if run == need:
            return MeshSpec(node - need + 1, need, 0, per_node)
    return None
