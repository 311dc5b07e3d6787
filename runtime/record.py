"""Recording an edge of the trainer's step: every item that crosses it, and the weights after.

Owns the on-disk form of ``debug.record`` (``runtime.replay`` reads it back). For each
recorded edge ``src->dst`` (``dst`` a ``batch`` node of the trainer's worker group) the run
writes ``<run>/record/<src>-<dst>/``:

* ``meta.json``: the edge, ``dst``'s input port, the trainer's torch threads, seed and the
  version-0 model folders (so the record replays even when the run died before its
  ``summary.json``);
* ``step_<n>.pt`` (``torch.save``): ``{"step", "indices", "attempts", "versions", "value"}``
  where ``value`` is what ``dst`` received on that port at step ``n`` (e.g. the advantage
  node's output: its ``batch`` tensors, ``trajectories`` and ``stats``), ``indices`` /
  ``attempts`` the admission indices and attempts of the step's groups, and ``versions``
  the per-token policy versions of every trajectory;
* ``digests.jsonl``: one line per (step, train_step node): :func:`state_digest` of its
  model's weights after that step.

A run that continues from a checkpoint of version ``v`` (a restarted trainer, a resume)
keeps the steps ``< v`` of its record and records the later ones anew
(:func:`rewind_records`, called by ``runtime.run_dir.rewind_run_dir``). It must not train or
decide what runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

RECORD_DIR = "record"


class RecordError(ValueError):
    """A ``debug.record`` edge the run cannot record (names the edge and why)."""


def parse_edge(edge: str) -> tuple[str, str]:
    """``"src->dst"`` -> ``("src", "dst")``.

    Raises:
        RecordError: not of that form.
    """
    src, sep, dst = edge.partition("->")
    if not sep or not src.strip() or not dst.strip():
        raise RecordError(f"edge {edge!r}: expected 'src->dst', e.g. 'advantage->train_step'")
    return src.strip(), dst.strip()


def edge_folder(run_dir: Path | str, edge: str, root: str = RECORD_DIR) -> Path:
    """``<run_dir>/<root>/<src>-<dst>`` (``root``: ``record``, or ``nonfinite`` for the
    batches of non-finite steps, ``runtime.nonfinite``)."""
    src, dst = parse_edge(edge)
    return Path(run_dir) / root / f"{src}-{dst}"


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """xxh64 (hex) over every tensor's name, dtype, shape and bytes, in name order: equal
    digests mean bit-identical weights (up to a 64-bit hash collision)."""
    h = xxhash.xxh64()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def check_edges(plan, edges: list[str], batch_nodes: list[str]) -> list[tuple[str, str, str]]:
    """Resolve ``debug.record`` edges to ``(src, dst, port)``.

    Raises:
        RecordError: an edge is malformed, not in the graph, or its ``dst`` is not one of
            ``batch_nodes`` (every step group's; listing the edges that can be recorded).
    """
    recordable = [f"{src}->{n.name}" for n in plan.nodes if n.name in batch_nodes for src, _ in n.inputs.values()]
    out = []
    for edge in edges:
        src, dst = parse_edge(edge)
        node = next((n for n in plan.nodes if n.name == dst), None)
        ports = [p for p, (s, _) in node.inputs.items() if s == src] if node is not None else []
        if not ports or dst not in batch_nodes:
            raise RecordError(f"debug.record: {edge!r} is not an edge into a batch node; "
                              f"recordable: {', '.join(sorted(set(recordable))) or 'none'}")
        out.append((src, dst, ports[0]))
    return out


def step_of(path: Path) -> int:
    """The step of a record file ``step_<n>.pt``."""
    return int(path.stem.split("_")[1])


def rewind_records(run_dir: Path, version: int) -> None:
    """Drop what every record under ``<run_dir>/record/`` holds of steps ``>= version`` (their
    ``step_<n>.pt`` and ``digests.jsonl`` lines): a run continuing from the checkpoint of
    policy ``version`` trains those steps again and records them anew; earlier steps are
    kept so a replay from the initial weights covers the whole run."""
    for folder in (Path(run_dir) / RECORD_DIR).glob("*"):
        for path in folder.glob("step_*.pt"):
            if step_of(path) >= version:
                path.unlink()
        digests = folder / "digests.jsonl"
        if digests.is_file():
            kept = [line for line in digests.read_text().splitlines() if json.loads(line)["step"] < version]
            digests.write_text("".join(f"{line}\n" for line in kept))


@dataclass
class EdgeRecorder:
    """Writes one edge's record (module doc) during a run.

    Args:
        folder: ``<run>/record/<src>-<dst>``. src / dst / port: the edge and ``dst``'s port.
    """

    folder: Path
    src: str
    dst: str
    port: str

    @classmethod
    def start(cls, run_dir: Path, src: str, dst: str, port: str, *, threads: int, seed: int,
              folders: dict, root: str = RECORD_DIR) -> "EdgeRecorder":
        """Create the folder (``<run_dir>/<root>/<src>-<dst>``) and write ``meta.json``. The
        steps already in it are kept: a new run's folder is empty, and a resumed or restarted
        run's was rewound to its checkpoint (:func:`rewind_records`), so the record keeps
        every step from 0 for ``replay``."""
        folder = edge_folder(run_dir, f"{src}->{dst}", root)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"edge": f"{src}->{dst}", "src": src, "dst": dst, "port": port, "threads": threads, "seed": seed,
                "folders": {k: str(v) for k, v in folders.items()}}
        (folder / "meta.json").write_text(json.dumps(meta, indent=2))
        return cls(folder, src, dst, port)

    def item(self, step: int, value, indices: list[int], attempts: list[int], trajectories: list) -> None:
        """Store what crossed the edge at ``step``."""
        torch.save({"step": step, "indices": indices, "attempts": attempts,
                    "versions": [list(t.versions) for t in trajectories], "value": value},
                   self.folder / f"step_{step}.pt")

    def digest(self, step: int, node: str, state: dict[str, torch.Tensor]) -> None:
        """Append the digest of ``node``'s weights after ``step``."""
        with (self.folder / "digests.jsonl").open("a") as fh:
            fh.write(json.dumps({"step": step, "node": node, "digest": state_digest(state)}) + "\n")
