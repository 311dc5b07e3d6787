"""Helpers of ``bench/gpu_check.sh``: what the GPU machine lacks, the wheel check, the result JSON.

    python bench/gpu_check.py hide                 # modules a dry run hides (GPU_CHECK_HIDE)
    python bench/gpu_check.py wheels DIR           # every wheel of bench/gpu_requirements.txt is in DIR
    python bench/gpu_check.py unpack DIR TARGET    # those wheels unzipped into TARGET (where pip is missing)
    python bench/gpu_check.py env DEVICE OUT       # torch / CUDA / GPU facts -> OUT; fails on cuda without CUDA
    python bench/gpu_check.py gain SUMMARY         # the main job's held-out accuracy before, after, gain
    python bench/gpu_check.py result WORK OUT      # WORK/steps.jsonl + the steps' outputs -> OUT (JSON)

The GPU machine (issue 27): one H200, Python 3.12 at ``python3`` with ``PREINSTALLED``, no
network. Everything else a run imports travels as wheels (``bench/gpu_requirements.txt``).
``hide`` lists the top-level modules of every distribution installed here that is neither in
the closure of ``PREINSTALLED`` and the wheels under their requirements (read from this
interpreter's metadata) nor pip/setuptools, plus the standard-library modules Python 3.12
removed: with them hidden a CPU run imports only what the GPU machine will have.
"""

from __future__ import annotations

import json
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "bench" / "gpu_requirements.txt"

PREINSTALLED = ("torch", "transformers", "tokenizers", "networkx", "cloudpickle", "xxhash", "tensorboard", "numpy",
                "tqdm", "pyyaml", "safetensors", "accelerate", "matplotlib", "hypothesis", "pytest", "pip",
                "setuptools")
"""Distributions on the GPU machine's Python (issue 27), with their dependencies."""

REMOVED_IN_312 = ("imp", "asynchat", "asyncore", "smtpd")
"""Standard-library modules Python 3.12 no longer has (distutils: setuptools provides it)."""

TARGET = {"python_version": "3.12", "python_full_version": "3.12.0", "implementation_version": "3.12.0",
          "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}


def norm(name: str) -> str:
    """A distribution name in PEP 503 normal form."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned() -> dict[str, str]:
    """``bench/gpu_requirements.txt`` as {normal name: version}; every line must be ``name==version``."""
    out = {}
    for raw in REQUIREMENTS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!]+)", line)
        if m is None:
            raise SystemExit(f"gpu_check.py: {REQUIREMENTS.name}: not name==version: {raw!r}")
        out[norm(m[1])] = m[2]
    return out


def closure(roots) -> set[str]:
    """``roots`` and every distribution installed here that they require (no extras, markers
    evaluated for the target's Python 3.12 on Linux x86_64)."""
    from packaging.requirements import Requirement

    seen, todo = set(), [norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({**TARGET, "extra": ""}):
                todo.append(norm(req.name))
    return seen


def hidden_modules() -> list[str]:
    """Top-level modules installed here that the GPU machine (preinstalled + wheels) lacks."""
    allowed = closure([*PREINSTALLED, *pinned()])
    hide = set(REMOVED_IN_312)
    for module, dists in metadata.packages_distributions().items():
        if module.isidentifier() and not any(norm(d) in allowed for d in dists):
            hide.add(module)
    hide -= {"areal_flow", "compiler", "runtime"}  # the project itself travels as a tree
    return sorted(hide)


def wheel_matches(filename: str, name: str, version: str) -> bool:
    """Is ``filename`` a wheel of ``name==version`` that CPython 3.12 on manylinux x86_64 installs?"""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) < 5 or norm(parts[0]) != name or parts[1] != version:
        return False
    pys, abis, plats = (set(p.split(".")) for p in parts[-3:])
    py_ok = bool(pys & {"py3", "cp312"}) or (bool(abis & {"abi3"}) and any(p.startswith("cp3") for p in pys))
    plat_ok = "any" in plats or any(p.endswith("x86_64") and p.startswith("manylinux") for p in plats)
    return py_ok and plat_ok and bool(abis & {"none", "abi3", "cp312"})


def find_wheels(folder: Path) -> tuple[list[Path], list[str]]:
    """The wheel in ``folder`` of each pinned requirement, and the requirements without one."""
    files = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    found, missing = [], []
    for name, version in pinned().items():
        match = [p for p in files if wheel_matches(p.name, name, version)]
        if match:
            found.append(match[0])
        else:
            missing.append(f"{name}=={version}")
    return found, missing


def check_wheels(folder: Path) -> int:
    """Print each pinned wheel found in ``folder`` and the total MiB; 1 (naming them) when any is missing."""
    found, missing = find_wheels(folder)
    total = sum(p.stat().st_size for p in found)
    for p in found:
        print(f"  {p.name}  {p.stat().st_size / 2**20:.2f} MiB")
    print(f"wheels: {len(pinned()) - len(missing)} of {len(pinned())} in {folder}, {total / 2**20:.2f} MiB")
    tree = tree_bytes()
    if tree is not None:
        print(f"with the code tree (git's tracked and untracked, not ignored files: {tree / 2**20:.2f} MiB): "
              f"{(tree + total) / 2**20:.2f} MiB of the 64 MiB a lent machine takes")
    if missing:
        print(f"gpu_check.py: missing wheels in {folder}: {', '.join(missing)} (run `make gpu-wheels` "
              f"where a package registry is reachable)", file=sys.stderr)
        return 1
    return 0


def tree_bytes() -> int | None:
    """Bytes of the working tree that travels to a lent machine (tracked and untracked files
    git does not ignore); None without git."""
    import subprocess

    try:
        names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, check=True).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def unpack(folder: Path, target: Path) -> int:
    """Unzip every pinned wheel of ``folder`` into ``target`` (a wheel is a zip of its
    site-packages files; enough for these, which have no scripts or data)."""
    import zipfile

    found, missing = find_wheels(folder)
    if missing:
        print(f"gpu_check.py: missing wheels in {folder}: {', '.join(missing)}", file=sys.stderr)
        return 1
    target.mkdir(parents=True, exist_ok=True)
    for p in found:
        with zipfile.ZipFile(p) as z:
            z.extractall(target)
        print(f"unpacked {p.name} into {target}")
    return 0


def env(device: str, out: Path) -> int:
    """Python, torch, CUDA and GPU facts into ``out`` (JSON); 1 when ``device`` is cuda and
    torch sees no CUDA device."""
    import platform

    import torch

    facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "cuda_available": torch.cuda.is_available(), "cpus": len(__import__("os").sched_getaffinity(0))}
    for name in ("transformers", "tokenizers", "zmq", "omegaconf"):
        try:
            facts[name] = getattr(__import__(name), "__version__", "?")
        except ImportError as exc:
            facts[name] = f"missing: {exc}"
    if torch.cuda.is_available():
        facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        facts["bf16_supported"] = torch.cuda.is_bf16_supported()
    print(json.dumps(facts, indent=2))
    out.write_text(json.dumps(facts, indent=2))
    if device == "cuda" and not facts["cuda_available"]:
        print("gpu_check.py: torch sees no CUDA device", file=sys.stderr)
        return 1
    return 0


def gain(summary_path: Path) -> int:
    """Print the main job's held-out accuracy before and after RL and the gain; 1 when the
    summary or its accuracies are missing (eval off, or the run did not finish)."""
    if not summary_path.is_file():
        print(f"gpu_check.py: no {summary_path}", file=sys.stderr)
        return 1
    summary = json.loads(summary_path.read_text())
    if "accuracy_before" not in summary or "accuracy_after" not in summary:
        print(f"gpu_check.py: {summary_path} has no accuracy_before / accuracy_after (eval.enabled?)", file=sys.stderr)
        return 1
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    print(f"main job: held-out {summary.get('eval_kind', 'accuracy')} {before:.1%} -> {after:.1%} "
          f"({100 * (after - before):+.1f} points), RL wall {summary['wall_s']:.1f} s, "
          f"{summary['samples_trained']} samples")
    return 0


def tail(path: Path, n: int = 3000) -> str | None:
    return path.read_text(errors="replace")[-n:] if path.is_file() else None


def figures(work: Path) -> dict:
    """The headline numbers the benchmarks printed (their logs in ``work``), by step; a step
    whose log lacks a line is left out (its log tail is in the result anyway)."""
    def text(step: str) -> str:
        path = work / f"{step}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    out: dict = {}
    engine = text("engine_throughput")
    rates = {m[1].strip(): float(m[2]) for m in
             re.finditer(r"^((?:embedded|HF generate) [^\n]*?)\s+([\d.]+) tokens/s", engine, re.M)}
    ratio = re.search(r"embedded bfloat16 vs HF generate bfloat16 \(wall clock\): ([\d.]+)x", engine)
    if rates:
        out["engine_throughput"] = {"tokens_per_s": rates,
                                    "bf16_vs_hf_bf16": float(ratio[1]) if ratio else None}
    train = re.findall(r"^(padded|padded\+budget|packed\+budget)\s+(fp32|bf16)\s+\d+\s+\d+\s+[\d.]+\s+(\d+)",
                       text("train_throughput"), re.M)
    models = re.findall(r"^(\S+): \d+ sequences", text("train_throughput"), re.M)
    if train and models:
        per = len(train) // len(models)
        out["train_throughput"] = {m: {f"{lay} {dt}": int(t) for lay, dt, t in train[i * per:(i + 1) * per]}
                                   for i, m in enumerate(models)}
    sync = re.search(r"(\d+) MB over (\w+): median ([\d.]+) GB/s, best ([\d.]+) GB/s", text("weight_sync"))
    seconds = [float(x) for x in re.findall(r"^version \d+: ([\d.]+) s", text("weight_sync"), re.M)]
    if sync:
        out["weight_sync"] = {"mb": int(sync[1]), "transport": sync[2], "median_gb_s": float(sync[3]),
                              "best_gb_s": float(sync[4]), "seconds": seconds}
    tail_text = text("longtail")
    speed = re.search(r"async speed-up \(mean sync / mean async\): loop ([\d.]+)x \(wall ([\d.]+)x\), "
                      r"ideal \(loop\) ([\d.]+)x", tail_text)
    if speed:
        out["longtail"] = {"async_vs_sync_loop": float(speed[1]), "async_vs_sync_wall": float(speed[2]),
                           "ideal_loop": float(speed[3])}
    return out


def result(work: Path, out: Path) -> int:
    """One JSON of the run's steps (name, rc, seconds, skipped), the main job's held-out
    accuracy gain and summary, and each bench's printed table (its log's tail)."""
    steps = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines() if line.strip()]
    res: dict = {"ok": all(s["status"] != "failed" for s in steps), "steps": steps}
    env = work / "env.json"
    if env.is_file():
        res["env"] = json.loads(env.read_text())
    summary_path = work / "runs" / "main" / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        keep = ("accuracy_before", "accuracy_after", "eval_kind", "wall_s", "samples_trained", "staleness_histogram")
        res["main_job"] = {k: summary[k] for k in keep if k in summary}
        if "accuracy_before" in summary and "accuracy_after" in summary:
            res["main_job"]["accuracy_gain"] = summary["accuracy_after"] - summary["accuracy_before"]
    res["figures"] = figures(work)
    res["logs"] = {s["name"]: tail(work / f"{s['name']}.log") for s in steps}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"results written to {out}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["hide"] and len(argv) == 1:
        print(" ".join(hidden_modules()))
        return 0
    if argv[:1] == ["wheels"] and len(argv) == 2:
        return check_wheels(Path(argv[1]))
    if argv[:1] == ["unpack"] and len(argv) == 3:
        return unpack(Path(argv[1]), Path(argv[2]))
    if argv[:1] == ["env"] and len(argv) == 3:
        return env(argv[1], Path(argv[2]))
    if argv[:1] == ["gain"] and len(argv) == 2:
        return gain(Path(argv[1]))
    if argv[:1] == ["result"] and len(argv) == 3:
        return result(Path(argv[1]), Path(argv[2]))
    print("usage: gpu_check.py hide | wheels DIR | unpack DIR TARGET | env DEVICE OUT | gain SUMMARY | "
          "result WORK OUT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
