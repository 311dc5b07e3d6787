"""Exact resume and a dead trainer restarted (issue 13): end-to-end runs whose trainer is
killed (loopback only, bounded in time). What a resume accepts and refuses (its arguments, its
plan, a complete run): test_resume_arguments; the checkpoint files and the rewound run folder:
test_checkpoint_files."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from runs import records
from runtime.checkpoint import latest_checkpoint

REPO = Path(__file__).resolve().parents[1]


def _models(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"x" * 10)


# --- end to end: a trainer killed mid-run ------------------------------------------------------

# A reward with signal even for a barely warmed-up policy (the parity of the first character),
# so every step moves the weights and the optimizer state matters.
PARITY_GRAPH = '''
from areal_flow import Model, flow, ops


def parity(output_text, answer):
    return float(ord(output_text[0]) % 2) if output_text else 0.0


@flow
def parity_grpo(cfg):
    policy = Model("policy", cfg.model)
    rollout = ops.generate(policy, ops.dataset(cfg.dataset), n_samples=cfg.gen.n_samples,
                           max_new_tokens=cfg.gen.max_new_tokens)
    adv = ops.advantage(rollout, ops.reward(rollout, fn=parity), estimator="grpo")
    stats = ops.train_step(policy, adv, algorithm="grpo", max_staleness=cfg.async_.max_staleness)
    ops.sync_weights(policy, to=rollout)
    return stats
'''
STEPS, B, N = 6, 2, 4  # steps x prompt groups x samples: 8 samples a step
RUN = [f"train.steps={STEPS}", f"train.batch_size={B}", f"gen.n_samples={N}", "warm_start.steps=10",
       "eval.enabled=false", "train.checkpoint_every=2", "train.lr=1e-2"]


def _cli(tmp_path: Path, name: str, *extra: str, graph: str = "") -> subprocess.Popen:
    """``areal-flow run`` of the parity graph (or ``graph``, with the YAML beside it)."""
    if graph:
        args = [str(REPO / graph)]
    else:
        (tmp_path / "parity.py").write_text(PARITY_GRAPH)
        args = [str(tmp_path / "parity.py"), "--config", str(REPO / "graphs/arith_grpo.yaml")]
    return subprocess.Popen([sys.executable, "-m", "areal_flow.cli", "run", *args, *RUN, f"out_dir={tmp_path}",
                             f"name={name}", *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, code: int = 0) -> str:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == code, err[-3000:]
    return err


def _kill_trainer_after(out: Path, step: int, killed: dict, inbox: str = "train_step-0") -> None:
    """Kill the process bound to the trainer's inbox (or another worker group's ``inbox``) once
    ``step`` is trained and a checkpoint is complete; ``killed["lines"]``: trained samples it had logged."""
    import psutil

    deadline, path = time.monotonic() + 400, out / "trajectories" / "trajectories.jsonl"
    while time.monotonic() < deadline:
        lines = len(path.read_text().splitlines()) if path.is_file() else 0
        if lines >= (step + 1) * B * N and latest_checkpoint(out) is not None:
            for child in psutil.Process().children(recursive=True):
                try:
                    if any(str(c.laddr).endswith(inbox) for c in child.net_connections(kind="unix")):
                        child.kill()
                        killed.update(pid=child.pid, lines=lines)
                        return
                except psutil.Error:
                    continue
        time.sleep(0.02)


def _run_killed(tmp_path: Path, name: str, *extra: str, code: int = 0, graph: str = "") -> tuple[str, dict]:
    killed: dict = {}
    proc = _cli(tmp_path, name, *extra, graph=graph)
    killer = threading.Thread(target=_kill_trainer_after, args=(tmp_path / name, 2, killed), daemon=True)
    killer.start()
    err = _finish(proc, code)
    killer.join(timeout=5)
    assert killed, "the trainer was not killed"
    return err, killed


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _event_steps(out: Path, tag: str = "rl/reward") -> list[int]:
    """The steps TensorBoard shows for ``tag`` over every event file of ``out`` (a resumed
    attempt's ``purge_step`` hides the dead attempt's later events)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def _exactly_once(out: Path, k: int) -> list[dict]:
    trained = records(out)
    ids = [r["sample_id"] for r in trained]
    assert len(ids) == STEPS * B * N == len(set(ids))  # every sample id once across the interruption
    assert Counter(r["group_id"] for r in trained) == {i: N for i in range(STEPS * B)}
    assert all(r["step"] == r["group_id"] // B for r in trained)  # index i trained at step i // B
    assert all(r["step"] - min(r["versions"]) <= k for r in trained)
    return trained


@pytest.mark.slow
def test_sync_run_resumed_from_a_checkpoint_reaches_the_same_weights(tmp_path, uninterrupted, warm_cache):
    whole = _weights(uninterrupted / "model")
    assert not _same(whole, _weights(uninterrupted / "checkpoints/version_2"))  # the steps after it trained
    err, _ = _run_killed(tmp_path, "cut", "async.max_staleness=0", "scheduler.max_restarts=0", code=1)
    assert "train_step/0 died (exit code -9); restarts so far 0, scheduler.max_restarts=0" in err
    assert not (tmp_path / "cut/model").exists()
    cut = latest_checkpoint(tmp_path / "cut")
    assert _same(_weights(cut.folder), _weights(uninterrupted / f"checkpoints/version_{cut.version}"))
    err = _finish(_cli(tmp_path, "cut", "async.max_staleness=0", "--resume", str(tmp_path / "cut")))
    assert f"resuming {tmp_path / 'cut'} from version_{cut.version} (step {cut.version} of {STEPS})" in err
    assert _same(_weights(tmp_path / "cut/model"), whole)  # bit-identical after the same steps
    _exactly_once(tmp_path / "cut", k=0)
    assert _event_steps(tmp_path / "cut") == list(range(STEPS))  # events continue, each step once
    summary = json.loads((tmp_path / "cut/summary.json").read_text())
    assert summary["samples_trained"] == STEPS * B * N and summary["restarts"]["resumed_from_version"] == cut.version
    _timeline_covers_both_attempts(tmp_path / "cut", cut.version)
    kept = {p: p.read_bytes() for p in (tmp_path / "cut/summary.json", tmp_path / "cut/trace.json")}
    err = _finish(_cli(tmp_path, "cut", "async.max_staleness=0", "--resume", str(tmp_path / "cut")))
    assert f"{tmp_path / 'cut'} is complete: version_{STEPS} holds all {STEPS} steps; nothing to resume" in err
    assert all(p.read_bytes() == data for p, data in kept.items())  # a complete run's resume writes nothing


def _timeline_covers_both_attempts(out: Path, version: int) -> None:
    """Issue 17: the interrupted attempt's spans are still in trace.json beside the resumed one's."""
    from runtime.timeline import load_events, summarize

    assert summarize(out).attempts == [0, version]
    steps = [e["args"]["step"] for e in load_events(out) if e["name"] == "train_step" and e["cat"] == "node"]
    assert set(steps) == set(range(STEPS)) and min(steps) == 0  # steps < version: trained by the first attempt
    from runtime.calibrate import compare

    c = compare(out)  # issue 17: --simulate on a resumed run, versions from the resume point
    assert c.calibration.first_version == version  # loads of versions version+1 .., the last one's maybe not
    assert c.calibration.versions in (STEPS - 1 - version, STEPS - version) and c.steps >= 1


@pytest.mark.slow
def test_sync_run_whose_trainer_dies_restarts_it_and_reaches_the_same_weights(tmp_path, uninterrupted, warm_cache):
    err, killed = _run_killed(tmp_path, "dies", "async.max_staleness=0", "scheduler.max_restarts=1")
    line = next(x for x in err.splitlines() if "restarting every worker" in x)
    assert line.startswith("areal-flow: train_step/0 died (exit code -9); restarting every worker from version_")
    assert _same(_weights(tmp_path / "dies/model"), _weights(uninterrupted / "model"))
    _exactly_once(tmp_path / "dies", k=0)
    assert _event_steps(tmp_path / "dies") == list(range(STEPS))
    assert len(list((tmp_path / "dies").glob("events.out.tfevents.*"))) == 2  # one per attempt, one folder
    restarts = json.loads((tmp_path / "dies/summary.json").read_text())["restarts"]
    version = int(line.split("from version_")[1].split()[0])
    # the groups trained after the checkpoint before the kill were admitted again (at least)
    assert restarts["trainer_restarts"] == 1 and restarts["replayed_groups"] >= (killed["lines"] // N) - version * B
    assert restarts["replica_restarts"] == 0 and restarts["dropped_duplicates"] == 0  # fresh replicas: none sent twice


@pytest.mark.slow
@pytest.mark.ci
def test_async_run_whose_trainer_dies_trains_every_sample_once_within_the_bound(tmp_path, warm_cache):
    _, killed = _run_killed(tmp_path, "async", "async.max_staleness=1", "scheduler.max_restarts=1")
    _exactly_once(tmp_path / "async", k=1)
    summary = json.loads((tmp_path / "async/summary.json").read_text())
    assert summary["restarts"]["trainer_restarts"] == 1 and summary["samples_trained"] == STEPS * B * N
    assert (tmp_path / "async/model/model.safetensors").is_file()


@pytest.mark.slow
def test_a_sigkilled_driver_leaves_nothing_running_and_resume_auto_continues_exactly(tmp_path, uninterrupted,
                                                                                    warm_cache):
    """Issue 26: the driver itself SIGKILLed (no handler runs) once its first checkpoint is
    complete: every process it started ends on its own (its workers by their parent-death
    signal, multiprocessing's resource tracker when they are gone), and ``resume=auto``
    continues from the last complete checkpoint to the uninterrupted run's weights (k = 0)."""
    import psutil

    out = tmp_path / "driver"
    proc = _cli(tmp_path, "driver", "async.max_staleness=0")
    deadline = time.monotonic() + 600
    while latest_checkpoint(out) is None:
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the kill"
        time.sleep(0.05)
    started = psutil.Process(proc.pid).children(recursive=True)
    assert len(started) >= 2  # a generation replica and the trainer at least
    proc.kill()
    proc.communicate(timeout=30)
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    cut = latest_checkpoint(out)
    assert cut.version < STEPS and not (out / "model").exists()
    err = _finish(_cli(tmp_path, "driver", "async.max_staleness=0", "resume=auto"))
    assert f"resuming {out} from version_{cut.version} (step {cut.version} of {STEPS})" in err
    assert _same(_weights(out / "model"), _weights(uninterrupted / "model"))  # bit-identical, k = 0
    _exactly_once(out, k=0)
    assert _event_steps(out) == list(range(STEPS))  # no step lost or repeated in TensorBoard


# --- what a resume accepts (compile only: no model runs) ---------------------------------------

TINY = ["train.steps=3", "train.batch_size=2", "gen.n_samples=4", "warm_start.steps=10", "eval.enabled=false"]


def _plan(tmp_path: Path, *overrides: str):
    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config
    from compiler.program import compile_program

    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*TINY, f"out_dir={tmp_path}", "name=exp", *overrides])
    return compile_program(load_flow(REPO / "graphs/arith_grpo.py")(cfg), cfg)


@pytest.mark.slow
def test_ppo_critic_and_its_optimizer_resume_bit_for_bit(tmp_path, warm_cache):
    """The critic is a second train_step (its own folder and optimizer in the checkpoint)."""
    _finish(_cli(tmp_path, "whole", "async.max_staleness=0", graph="graphs/arith_ppo.py"))
    _run_killed(tmp_path, "dies", "async.max_staleness=0", "scheduler.max_restarts=1", graph="graphs/arith_ppo.py")
    assert (tmp_path / "dies/checkpoints/version_2/critic/value_head.pt").is_file()
    for model in ("model", "critic"):
        assert _same(_weights(tmp_path / "dies" / model), _weights(tmp_path / "whole" / model))
    heads = [torch.load(tmp_path / run / "critic/value_head.pt", weights_only=True) for run in ("whole", "dies")]
    assert _same(*heads)
    assert not _same(_weights(tmp_path / "whole/critic"), _weights(tmp_path / "whole/checkpoints/version_2/critic"))
    _exactly_once(tmp_path / "dies", k=0)


class _TwoPrompts:
    """A task whose training prompts are fixed, so the longest is known by hand."""

    def train_problems(self, n: int, seed: int) -> list[dict]:
        return [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+20=", "answer": "30"}]


def test_a_token_budget_below_the_longest_trajectory_is_refused_before_workers(tmp_path):
    from areal_flow.config import ConfigError
    from areal_flow.models.tokenizer import build_char_tokenizer
    from runtime.run_setup import RunSetup

    build_char_tokenizer().save_pretrained(tmp_path / "policy")
    # longest prompt "10+20=": <bos> + 6 characters = 7 tokens; + gen.max_new_tokens 5 = 12 tokens
    for budget, refused in ((11, True), (12, False)):
        setup = RunSetup.create(_plan(tmp_path, "train.pack_sequences=true",
                                      f"train.max_tokens_per_micro_batch={budget}"), show_progress=False)
        setup.task, setup.folders = _TwoPrompts(), {setup.topo.generate.model: str(tmp_path / "policy")}
        if refused:
            with pytest.raises(ConfigError, match=r"train.max_tokens_per_micro_batch=11 \(train_step 'train_step'\) "
                                                  r"is below .*prompt \(7 tokens\) .*set it to at least 12"):
                setup._check_token_budget()
        else:
            setup._check_token_budget()


@pytest.mark.slow
def test_ctrl_c_on_the_local_scheduler_names_the_last_checkpoint(tmp_path, warm_cache, capsys):
    """Issue 13: as on Ray (test_ray_scheduler), Ctrl-C says which checkpoint a resume continues from."""
    import _thread

    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config
    from areal_flow.cli.run import run_experiment

    (tmp_path / "parity.py").write_text(PARITY_GRAPH)
    cfg = load_config(REPO / "graphs/arith_grpo.yaml", [*RUN, "train.steps=40", f"out_dir={tmp_path}", "name=stop"])
    second = tmp_path / "stop/checkpoints/version_2"

    def interrupt() -> None:
        deadline = time.monotonic() + 300
        while latest_checkpoint(tmp_path / "stop") is None or not second.is_dir():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run_experiment(load_flow(tmp_path / "parity.py")(cfg), cfg, show_progress=False)
    last = latest_checkpoint(tmp_path / "stop")
    line = next(x for x in capsys.readouterr().err.splitlines() if "interrupted after" in x)
    assert line.endswith(f"of 40 steps; last checkpoint: {last.folder} (areal-flow run ... --resume "
                         f"{tmp_path / 'stop'} continues from it)"), line
    assert 2 <= last.version < 40  # stopped mid-run, the workers before the line: no checkpoint after the named one
