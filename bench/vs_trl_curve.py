"""Time to accuracy for ``bench/vs_trl.py --curve N``: held-out accuracy every ``N`` optimizer
steps on both sides, each point at the training time it was reached, and when each runner (an
areal-flow run, or a TRL twin of ``--trl-rng``) first reached a TRL run's final accuracy.

* TRL: :class:`Snapshots`, a ``TrainerCallback`` that copies the policy's ``state_dict`` every
  ``N`` steps (and at the last) with the time since ``train()`` began; the copying is timed
  and left out of that time and of the run's training time. Scored after ``train()``.
* areal-flow: ``train.checkpoint_every=N`` (each checkpoint a ``transformers`` folder of the
  policy, ``runtime.checkpoint``); version ``v``'s time is the end of the trainer's ``train_step``
  span of step ``v - 1`` on the loop's clock (from the generator's first engine step, less the
  start-up wait, as ``bench/async_vs_sync.loop_window``), less the ``checkpoint`` spans before it
  (the trainer writes each between steps; optimizer state and fsync included, so far more than
  TRL's copy in memory; the generator may run on meanwhile, within its staleness bound). The run's
  loop time (the speed ratio) keeps them.

Both are scored by the same evaluator as the final accuracy (``runtime.evaluate.greedy_accuracy``).
"""

from __future__ import annotations

import time
from pathlib import Path

Point = tuple[int, float, float]
"""``(step, seconds of training when reached, held-out accuracy)``."""


def snapshots(every: int, model):
    """A ``transformers.TrainerCallback`` (built here: ``transformers`` is imported in the TRL
    process only) keeping ``points``: ``(step, seconds since train() began less the copying,
    state_dict copy)`` every ``every`` steps and at the last; ``paused_s``: seconds spent copying."""
    import transformers

    class Snapshots(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.points: list[tuple[int, float, dict]] = []
            self.paused_s = 0.0
            self.begin = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % every and state.global_step != state.max_steps:
                return
            t = time.perf_counter()
            copy = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.points.append((state.global_step, t - self.begin - self.paused_s, copy))
            self.paused_s += time.perf_counter() - t

    return Snapshots()


def score_snapshots(model, points: list[tuple[int, float, dict]], score) -> list[Point]:
    """Load each snapshot into ``model`` and ``score(model)`` it; the model ends on the last."""
    out = []
    for step, seconds, state in points:
        model.load_state_dict(state)
        out.append((step, seconds, score(model)))
    return out


def areal_points(out_dir: Path, start_us: int, waited_s: float, spans: list[dict], score,
                 node: str = "train_step") -> list[Point]:
    """The curve of an areal-flow run with ``train.checkpoint_every`` set: for each
    ``checkpoints/version_<v>`` folder, ``(v, loop seconds at the end of the train_step span of step
    v - 1 less the checkpoint writes before it, score(model))``; ``start_us`` and ``waited_s`` as
    ``async_vs_sync.loop_window`` gives them. Only the process that ran ``node``'s step spans counts
    (the policy trainer; a step traced twice, as after a resume, by its last span).

    Raises:
        ValueError: the run wrote no checkpoint, or a checkpoint's step has no ``node`` span.
    """
    from runtime.model_source import load_pretrained

    steps = [s for s in spans if s["name"] == node and s["cat"] == "node" and "step" in s.get("args", {})]
    trainer = steps[0]["proc"] if steps else None
    ends = {s["args"]["step"]: s["ts"] + s["dur"] for s in sorted(steps, key=lambda s: s["ts"]) if s["proc"] == trainer}
    writes = [(s["ts"] + s["dur"], s["dur"]) for s in spans
              if s["name"] == "checkpoint" and s["cat"] == "io" and s["proc"] == trainer]
    folders = sorted((int(p.name.split("_")[1]), p) for p in (out_dir / "checkpoints").glob("version_*")
                     if p.name.split("_")[1].isdigit())
    if not folders:
        raise ValueError(f"{out_dir}: no checkpoints/version_<v> (train.checkpoint_every unset?)")
    out = []
    for version, folder in folders:
        if version - 1 not in ends:
            raise ValueError(f"{folder}: no {node!r} span of step {version - 1} in the trace")
        end = ends[version - 1]
        writing = sum(d for e, d in writes if e <= end)
        model, _ = load_pretrained(folder)
        out.append((version, (end - start_us - writing) / 1e6 - waited_s, score(model)))
    return out


def first_reaching(points: list[Point], target: float) -> Point | None:
    """The first point whose accuracy is at least ``target`` (None: none)."""
    return next((p for p in points if p[2] >= target), None)


def curve_text(points: list[Point]) -> str:
    """``step@seconds:accuracy`` for each point, e.g. ``50@7.1s:72.4%``."""
    return ", ".join(f"{s}@{t:.1f}s:{a:.1%}" for s, t, a in points)


def reach_line(label: str, points: list[Point], trl_label: str, trl_points: list[Point]) -> str:
    """How soon ``label``'s run reached ``trl_label``'s final accuracy, against TRL's own time to it:
    the ratio of TRL's training time at its last point to the runner's first point at or above it."""
    steps, trl_s, target = trl_points[-1]
    hit = first_reaching(points, target)
    if hit is None:
        best = max(points, key=lambda p: p[2])
        return (f"{label} did not reach {trl_label}'s final {target:.1%} (step {steps}, {trl_s:.1f} s) in its "
                f"{points[-1][0]} steps; best {best[2]:.1%} at step {best[0]}, {best[1]:.1f} s")
    return (f"{label} reached {trl_label}'s final {target:.1%} at step {hit[0]}, {hit[1]:.1f} s, against TRL's "
            f"{trl_s:.1f} s (step {steps}): {trl_s / hit[1]:.2f}x")
