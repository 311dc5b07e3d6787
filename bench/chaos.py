"""Benchmark (not a test): Jepsen-style random kills of a long run, then its invariants.

Starts ``areal-flow run graphs/arith_grpo.py`` (tiny model, evaluation off, checkpoints every
``--checkpoint-every`` steps) as a user would, in a subprocess, on the ``local`` or the
``ray`` scheduler, at ``async.max_staleness = --k``. Every uniform(``--every``) seconds it
SIGKILLs one live process of the run, its kind drawn uniformly among those alive (the
driver, a generation replica, the trainer, another stage worker, a trainer rank; on Ray an
actor's worker process, or the raylet / GCS of the run's own Ray cluster), then acts as a
supervisor: a dead driver (or the run's one Ray node: its raylet or GCS), or a run that ends
in failure, is waited for until no process of it is left (one alive ``--leak-wait-s`` later
is a leak) and the same command is started again with ``--resume <run folder>`` (or afresh
when no checkpoint exists yet); a dead worker must be restarted by the runtime itself (a run
that stops instead is a finding), the run's steps going on past the step of the kill within
``--hang-s`` (else the hang is a finding and the driver is killed and resumed). Kills stop after
``--minutes``; the run then finishes its ``--steps``. The same job then runs uninterrupted
(same seed and config; ``--reference parallel`` runs it beside the chaos run instead).
``--nodes N`` (``bench/chaos_ray.py``) runs it instead on a cluster of ``N`` raylets the bench
starts, ``gen:d1 + train:d2`` over three of them, and adds the victims such a cluster has: a
whole worker node removed (a spare added back), the trainer's rank host killed with
``ray.kill``, an actor's process SIGKILLed; the reference then runs after it on that cluster.

It prints each kill (victim, step, what the recovery did, seconds to the next trained step),
a table of kills per victim kind, and checks (``bench/chaos_checks.py``): every sample id
trained exactly once at its step, every token's staleness ``<= k``, the steps of
``steps.jsonl`` and of TensorBoard each ``0 .. steps-1`` once, at ``k = 0`` final weights bit
for bit the uninterrupted run's, at ``k > 0`` the same samples and steps counted, no process,
listening port or file of the run left (its private ``TMPDIR``, ``/dev/shm`` entries naming
one of its processes, ``*.tmp`` checkpoints), and the driver's and workers' RSS bounded
(median of the last quarter of the samples over the first's <= 1.25). Exit code 1 names
every invariant that failed.

    python bench/chaos.py --minutes 20 --steps 3000 --k 0 [--scheduler ray | --nodes 3] [--every 20:90] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import chaos_checks as checks  # noqa: E402
from bench.chaos_logs import event_steps, final_line, last_line, last_step, restart_said, said  # noqa: E402
from bench.chaos_procs import DRIVER, GCS, RAYLET, RunProcesses, kill_and_reap  # noqa: E402
from bench.chaos_ray import RayNodes, draw  # noqa: E402
from runtime.checkpoint import latest_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
KEPT = ("ray", "torchinductor_")  # Ray's session logs, torch.compile's cache: kept by design
SETTLE_S = 30.0
INF = float("inf")
NODE_GRACE_S = 120.0  # Ray's driver gives up on a dead GCS after 60 s (gcs_rpc_server_reconnect_timeout_s)
WHOLE_RUN = (DRIVER, RAYLET, GCS)  # their death ends the run (the run's one Ray node): resumed, not restarted
SMALL = ["train.batch_size=2", "gen.n_samples=4", "eval.enabled=false", "logging.trace=false",
         "scheduler.max_restarts=1000"]


@dataclass
class Kill:
    """One kill and what followed it."""

    t: float  # seconds since the chaos run started
    kind: str
    pid: int
    step: int  # last step in steps.jsonl when killed
    recovery: str = ""
    seconds: float = 0.0  # kill to step ``step + k + 3`` trained by the live attempt (or the run's end)
    ok: bool = True
    gone_s: float = 0.0  # a dead run's processes: seconds until the last was gone
    said_before: int = 0  # areal-flow: lines in the attempt's log when killed


@dataclass
class Chaos:
    """The chaos run's state: its command, attempts, kills, samples and findings."""

    args: argparse.Namespace
    out: Path
    tmpdir: Path
    kills: list[Kill] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    attempts: int = 0
    rss: list[tuple[float, float]] = field(default_factory=list)  # (driver MiB, workers MiB), settled samples
    procs: RunProcesses | None = None
    nodes: RayNodes | None = None  # --nodes: the bench's own multi-node Ray cluster

    @property
    def run_dir(self) -> Path:
        return self.out / "chaos"

    def command(self, name: str, resume: bool) -> list[str]:
        a = self.args
        cli = ["run", str(REPO / "graphs/arith_grpo.py"), *SMALL, f"train.steps={a.steps}",
               f"async.max_staleness={a.k}", f"scheduler.type={a.scheduler}",
               f"train.checkpoint_every={a.checkpoint_every}", "train.keep_checkpoints=3", f"out_dir={self.out}",
               f"name={name}"]
        cmd = self.nodes.command(cli) if self.nodes else [sys.executable, "-m", "areal_flow.cli", *cli]
        cmd += a.overrides
        return [*cmd, "--resume", str(self.out / name)] if resume else cmd

    def start(self, name: str = "chaos") -> subprocess.Popen:
        """Start an attempt of run ``name``: ``--resume`` its folder once it holds a complete
        checkpoint, else afresh (as ``resume=auto`` would); console to ``<name>-attempt<n>.log``."""
        resume = latest_checkpoint(self.out / name) is not None
        self.attempts += name == "chaos"
        env = {**os.environ, "TMPDIR": str(self.tmpdir), "PYTHONPATH": str(REPO)}
        with (self.out / (f"chaos-attempt{self.attempts}.log" if name == "chaos" else f"{name}.log")).open("w") as log:
            return subprocess.Popen(self.command(name, resume), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    env=env)


class Supervisor:
    """Starts the run's attempts, samples them, kills, and recovers as a user would."""

    def __init__(self, chaos: Chaos, rng: random.Random) -> None:
        self.chaos, self.rng = chaos, rng
        self.proc = chaos.start()
        self.since = time.time()  # steps.jsonl written since then: by this attempt
        self.last_rss = 0.0
        self.settled = INF  # RSS samples from SETTLE_S after this attempt's first step
        self.recovering = False

    @property
    def log(self) -> Path:
        return self.chaos.out / f"chaos-attempt{self.chaos.attempts}.log"

    def tick(self) -> None:
        """Remember the run's processes; an RSS sample every 2 s once the workers settled
        (``SETTLE_S`` after an attempt's first step or a recovery; none while recovering: a
        restarted worker grows while it warms up)."""
        self.chaos.procs.scan(self.proc.pid)
        now = time.monotonic()
        if self.settled == INF and not self.recovering and last_step(self.chaos.run_dir, self.since) >= 0:
            self.settled = now + SETTLE_S
        if now - self.last_rss >= 2 and now >= self.settled and last_step(self.chaos.run_dir, self.since) >= 1:
            self.last_rss = now
            driver, workers = self.chaos.procs.rss(self.proc.pid)
            workers += self.chaos.nodes.actors_rss() if self.chaos.nodes else 0
            if driver:
                self.chaos.rss.append((driver / MIB, workers / MIB))

    def restart(self, what: str) -> float:
        """Wait until no process of the run is left (each one left ``--leak-wait-s`` later is
        a finding, then killed), and start the run again (``--resume`` once a checkpoint
        exists). Returns the seconds until the last of them was gone."""
        self.proc.wait()
        start, wait = time.monotonic(), self.chaos.args.leak_wait_s
        left = self.chaos.procs.alive(timeout=wait)
        gone_s = time.monotonic() - start
        for p in left:
            self.chaos.findings.append(f"after {what}: {self.chaos.procs.describe(p)} alive {wait:.0f} s later")
        kill_and_reap(left)
        self.proc = self.chaos.start()
        self.since = time.time()
        self.settled = INF
        return gone_s

    def run(self) -> None:
        """Kill every uniform(--every) s until --minutes have passed; return when the run completes."""
        a, chaos = self.chaos.args, self.chaos
        low, high = (float(x) for x in a.every.split(":"))
        begin = time.monotonic()
        next_kill = begin + self.rng.uniform(low, high)
        while True:
            self.tick()
            code = self.proc.poll()
            if code == 0:
                return
            if code is not None:
                chaos.findings.append(f"attempt {chaos.attempts} ended with exit code {code} unprovoked: "
                                      f"{final_line(self.log)}")
                print(f"[{time.monotonic() - begin:7.1f} s] {chaos.findings[-1]}", flush=True)
                self.restart(f"attempt {chaos.attempts}'s exit")
                continue
            now = time.monotonic()
            victims = self.chaos.procs.victims(self.proc.pid) if now >= next_kill else {}
            if victims and chaos.nodes:
                victims.update(chaos.nodes.victims("chaos"))
            drawn = draw(self.rng, victims, a.victims)
            if now - begin > a.minutes * 60 or not drawn:
                time.sleep(0.2)
                continue
            kind, victim = drawn
            kill = Kill(round(now - begin, 1), kind, 0, last_step(chaos.run_dir), said_before=len(said(self.log)))
            try:
                if isinstance(victim, psutil.Process):
                    kill.pid = victim.pid
                    victim.send_signal(signal.SIGKILL)
                else:
                    kill.pid = chaos.nodes.kill(kind, victim)
            except (psutil.Error, ValueError):  # gone meanwhile
                continue
            chaos.kills.append(kill)
            self.settled, self.recovering = INF, True
            self.recover(kill)
            self.settled, self.recovering = time.monotonic() + SETTLE_S, False
            print(f"[{kill.t:7.1f} s] killed {kill.kind} (pid {kill.pid}) at step {kill.step}: {kill.recovery}; "
                  f"{kill.seconds:.1f} s to step {kill.step + a.k + 3}", flush=True)
            next_kill = time.monotonic() + self.rng.uniform(low, high)

    def recover(self, kill: Kill) -> None:
        """Supervise after ``kill`` until the run trains step ``kill.step + k + 3`` (past every
        group admitted before the kill: at most ``(k + 2) * B`` groups are admitted and not
        trained, docs/RELIABILITY.md's soak) or completes; a dead driver or a failed run is
        resumed, a run without progress for ``--hang-s`` is a hang (a finding), killed and resumed."""
        a, chaos = self.chaos.args, self.chaos
        start = deadline = time.monotonic()
        deadline += a.hang_s
        target = min(kill.step + a.k + 3, a.steps - 1)
        killed_under = self.proc.pid  # a Ray node's death ends its driver only later (GCS: 60 s)
        first_attempt = self.chaos.attempts
        while True:
            self.tick()
            code = self.proc.poll()
            if code == 0:
                kill.recovery = kill.recovery or "the run completed"
                break
            if code is not None:
                line = final_line(self.log)
                if self.chaos.attempts > first_attempt:  # a start after the kill failed too: a resume refused
                    kill.ok = False
                    chaos.findings.append(f"{kill.kind} killed at step {kill.step}: attempt {chaos.attempts} after it "
                                          f"ended with exit code {code}: {line}")
                elif kill.kind not in WHOLE_RUN:
                    kill.ok = False
                    chaos.findings.append(f"{kill.kind} killed at step {kill.step}: the run stopped instead of "
                                          f"restarting it: {line}")
                kill.gone_s = max(kill.gone_s, self.restart(f"the {kill.kind}'s kill at step {kill.step}"))
                deadline = time.monotonic() + a.hang_s  # each start gets the whole --hang-s
                kill.recovery = (f"{kill.kind} dead" if kill.kind in WHOLE_RUN else f"run stopped ({line})") + \
                    f"; its processes gone in {kill.gone_s:.1f} s; resumed"
                continue
            ray_grace = kill.kind in (RAYLET, GCS) and time.monotonic() - start < NODE_GRACE_S
            if last_step(chaos.run_dir, self.since) >= target and not (ray_grace and self.proc.pid == killed_under):
                kill.recovery = kill.recovery or restart_said(said(self.log)[kill.said_before:])
                break
            if time.monotonic() > deadline:
                kill.ok = False
                kill.recovery = f"HANG: no step {target} in {a.hang_s:.0f} s; driver killed, resumed"
                chaos.findings.append(f"{kill.kind} killed at step {kill.step}: no step {target} within "
                                      f"{a.hang_s:.0f} s; last line: {last_line(self.log)}")
                kill_and_reap([psutil.Process(self.proc.pid)])
                self.restart("the hung run's driver kill")
                deadline = time.monotonic() + a.hang_s
            time.sleep(0.2)
        kill.seconds = time.monotonic() - start


def leaked_files(chaos: Chaos, shm_before: set[str]) -> list[str]:
    """Files the run left: anything in its private TMPDIR (but ``KEPT``), ``/dev/shm``
    entries made since the start whose name holds one of its pids, and
    unfinished ``*.tmp`` checkpoints. ``KEPT``: caches and logs other tools keep on purpose."""
    left = [str(p) for p in chaos.tmpdir.rglob("*") if not p.relative_to(chaos.tmpdir).parts[0].startswith(KEPT)]
    pids = {str(p) for p in chaos.procs.ever}
    for name in set(os.listdir("/dev/shm")) - shm_before:
        if pids & set("".join(c if c.isdigit() else " " for c in name).split()):
            left.append(f"/dev/shm/{name}")
    return left + [str(p) for p in (chaos.run_dir / "checkpoints").glob("*.tmp")]


def verify(chaos: Chaos, reference: Path, shm_before: set[str], ray_left: list[str]) -> dict[str, list[str]]:
    """Every invariant's problems (empty lists: it holds); prints the measured figures."""
    import torch
    import yaml
    from safetensors.torch import load_file

    a, run = chaos.args, chaos.run_dir
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    b, n = cfg["train"]["batch_size"], cfg["gen"]["n_samples"]
    records = [json.loads(x) for x in (run / "trajectories" / "trajectories.jsonl").read_text().splitlines()]
    steps = [json.loads(x)["step"] for x in (run / "steps.jsonl").read_text().splitlines()]
    found = {"samples trained exactly once": checks.exactly_once(records, a.steps, b, n),
             f"staleness <= {a.k} for every token": checks.staleness_within(records, a.k),
             "steps.jsonl: every step once": checks.steps_contiguous(steps, a.steps, "steps.jsonl"),
             "TensorBoard: every step once": checks.steps_contiguous(event_steps(run), a.steps, "rl/reward")}
    if a.k == 0:
        found["final weights bit-identical to the uninterrupted run's"] = checks.same_tensors(
            load_file(run / "model/model.safetensors"), load_file(reference / "model/model.safetensors"), torch.equal)
    else:
        mine, ref = (json.loads((d / "summary.json").read_text())["samples_trained"] for d in (run, reference))
        ref_steps = len((reference / "steps.jsonl").read_text().splitlines())
        found["same accounting as the uninterrupted run"] = (
            [] if (mine, len(steps)) == (ref, ref_steps) else
            [f"{mine} samples / {len(steps)} steps, uninterrupted {ref} / {ref_steps}"])
    alive = [chaos.procs.describe(p) for p in chaos.procs.alive(timeout=30)]
    found["no leaked process, port or file"] = checks.nothing_left(
        alive, chaos.procs.listening_ports(), leaked_files(chaos, shm_before))
    if chaos.nodes:
        found["nothing left on the Ray cluster"] = ray_left
    (chaos.out / "rss.csv").write_text("driver_mib,workers_mib\n" + "".join(f"{d:.1f},{w:.1f}\n" for d, w in chaos.rss))
    ratios = {}
    for i, what in enumerate(("driver", "workers")):
        series = [s[i] for s in chaos.rss]
        ratios[what], problems = checks.rss_bounded(series, what)
        found.setdefault("RSS bounded", []).extend(problems)
        print(f"{what} RSS: max {max(series, default=0):.1f} MiB, last / first quarter median {ratios[what]:.3f} "
              f"({len(series)} samples)")
    found["every kill recovered"] = chaos.findings
    return found


def report(chaos: Chaos, wall_s: float, found: dict[str, list[str]]) -> None:
    """The kills per victim kind, then each invariant: OK or its problems."""
    print(f"\nchaos run: {chaos.args.steps} steps, k = {chaos.args.k}, {chaos.args.scheduler} scheduler, "
          f"{wall_s / 60:.1f} min, {len(chaos.kills)} kills, {chaos.attempts} attempts (driver starts)")
    print(f"{'victim':<20} {'kills':>5} {'ok':>4} {'median s':>9} {'max s':>7} {'gone s':>7}  recoveries "
          "(s: kill to step + k + 3; gone s: the slowest of a dead run's processes to end)")
    for kind in sorted({k.kind for k in chaos.kills}):
        mine = [k for k in chaos.kills if k.kind == kind]
        secs = sorted(k.seconds for k in mine)
        how: dict[str, int] = {}
        for k in mine:
            key = k.recovery.split(" (")[0].split(";")[0].split(":")[0].split(" from ")[0]
            how[key] = how.get(key, 0) + 1
        print(f"{kind:<20} {len(mine):5d} {sum(k.ok for k in mine):4d} {statistics.median(secs):9.1f} {secs[-1]:7.1f} "
              f"{max(k.gone_s for k in mine):7.1f}  "
              + "; ".join(f"{c} x {h}" for h, c in how.items()))
    for name, problems in found.items():
        print(f"{'OK  ' if not problems else 'FAIL'} {name}")
        for p in problems:
            print(f"       {p}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="kill for this long (then the run finishes)")
    parser.add_argument("--steps", type=int, default=3000, help="train.steps of the run")
    parser.add_argument("--k", type=int, default=0, help="async.max_staleness")
    parser.add_argument("--scheduler", choices=("local", "ray"), default="local")
    parser.add_argument("--nodes", type=int, default=0, help="a multi-node Ray cluster of this many raylets "
                        "started here (bench/chaos_ray.py; implies --scheduler ray, --reference after)")
    parser.add_argument("--every", default="20:90", help="LOW:HIGH, seconds between kills (uniform)")
    parser.add_argument("--victims", default="all", help="comma-separated kinds to kill (default all)")
    parser.add_argument("--hang-s", type=float, default=180.0, help="no progress this long after a kill: a hang")
    parser.add_argument("--leak-wait-s", type=float, default=60.0,
                        help="a process of a dead run still alive this long after: a leak")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="train.checkpoint_every")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bench's draws (victims, moments)")
    parser.add_argument("--reference", choices=("after", "parallel"), default="after",
                        help="run the uninterrupted job after the chaos run, or beside it")
    parser.add_argument("--out", default="", help="folder of both runs and the logs (default: a new temp folder)")
    parser.add_argument("overrides", nargs="*", help="config overrides after the bench's")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="chaos-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tmpdir = Path(tempfile.mkdtemp(prefix="tmp-", dir="/tmp"))
    shm_before = set(os.listdir("/dev/shm"))
    if args.nodes:
        args.scheduler, args.reference = "ray", "after"  # one cluster: the runs take turns on its devices
    chaos = Chaos(args, out, tmpdir, procs=RunProcesses(), nodes=RayNodes(args.nodes) if args.nodes else None)
    print(f"chaos bench: runs and logs in {out}; run TMPDIR {tmpdir}", flush=True)
    try:  # the bench's own cluster is removed whatever happens
        ref_proc = chaos.start("reference") if args.reference == "parallel" else None
        begin = time.monotonic()
        Supervisor(chaos, random.Random(args.seed)).run()
        wall_s = time.monotonic() - begin
        ray_left = chaos.nodes.leaks(args.leak_wait_s) if chaos.nodes else []
        ref_proc = ref_proc or chaos.start("reference")
        code = ref_proc.wait()
    finally:
        if chaos.nodes:
            chaos.nodes.shutdown()
    if code != 0:
        print(f"the uninterrupted run failed: see {out}/reference.log")
        return 1
    found = verify(chaos, out / "reference", shm_before, ray_left)
    report(chaos, wall_s, found)
    failed = [name for name, problems in found.items() if problems]
    print("all invariants hold" if not failed else f"FAILED: {'; '.join(failed)}")
    if not failed:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
