"""The printed side of ``bench/vs_trl.py``: one run's line, the held-out accuracy before RL,
and each seed's side-by-side table with speed ratios and (``--curve``) time to accuracy."""

from __future__ import annotations

import statistics

from vs_trl_curve import curve_text, first_reaching, reach_line
from vs_trl_jobs import Variant


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_line(v: Variant, r: dict) -> str:
    """One run's figures: loop, samples/s, accuracy, the generation / training split."""
    acc = "n/a" if r["accuracy_after"] is None else f"{r['accuracy_after']:.1%}"
    if v.side == "trl":
        train = r["train_s"] - r["gen_s"] - r["score_s"]
        extra = (f"generate {r['gen_s']:.1f} s ({r['gen_s'] / r['train_s']:.0%}), rewards/advantages "
                 f"{r['score_s']:.1f} s, training (rest) {train:.1f} s ({train / r['train_s']:.0%}), setup "
                 f"{r['setup_s']:.1f} s, trl {r['trl']}")
    else:
        extra = (f"RL wall {r['wall_s']:.1f} s, generator busy {r['gen_s']:.1f} s ({r['gen_s'] / r['train_s']:.0%}), "
                 f"trainer busy {r['trainer_s']:.1f} s ({r['trainer_s'] / r['train_s']:.0%}), worker pids "
                 f"{r['pids']}; medians ms: " + ", ".join(f"{n} {v_:.1f}" for n, v_ in r["phases"].items()))
    return (f"loop {r['train_s']:6.1f} s, {r['samples'] / r['train_s']:6.1f} samples/s, held-out after {acc} "
            f"({extra})")


def before_accuracy(results: dict, runs: list[Variant], seed: int, folder: str, task, test, shared: dict,
                    no_eval: bool) -> float | None:
    """Held-out greedy accuracy of the shared version-0 policy (an areal-flow run's, else scored here)."""
    if no_eval:
        return None
    for v in runs:
        if v.side == "areal" and results[(seed, v.label)][0].get("accuracy_before") is not None:
            return results[(seed, v.label)][0]["accuracy_before"]
    from runtime.evaluate import greedy_accuracy
    from runtime.model_source import load_pretrained

    model, tok = load_pretrained(folder)
    return greedy_accuracy(model, tok, task, test, chat_template=shared["chat_template"])


def report(seed: int, runs: list[Variant], results: dict, before: float | None) -> None:
    """The side-by-side table of one seed: medians over its rounds, speed ratios (samples/s of the
    loop, so runs of different lengths compare: ``--areal-steps``) against the fastest TRL variant
    (twins, ``--trl-rng`` > 0, left out) and against TRL of the same precision (fp32 with fp32 engines, bf16 with 16-bit ones,
    ``gen.dtype=auto`` by what the engine chose), generation's share of each loop."""
    trls = [v for v in runs if v.side == "trl" and v.rng == 0]  # a twin (rng > 0) is a control, not a peer
    loop = {v.label: median([r["train_s"] for r in results[(seed, v.label)]]) for v in runs}
    rates = {v.label: median([r["samples"] / r["train_s"] for r in results[(seed, v.label)]]) for v in runs}
    fastest = max((rates[v.label] for v in trls), default=float("nan"))
    rounds = len(results[(seed, runs[0].label)])
    head = "not scored (--no-eval)" if before is None else f"{before:.1%} (same policy)"
    print(f"\nseed {seed} (medians of {rounds} round(s)); held-out accuracy before RL {head}")
    samples = {v.label: results[(seed, v.label)][0]["samples"] for v in runs}
    if len(set(samples.values())) > 1:  # --areal-steps: "after" is each run's own end
        print("runs of different lengths, 'after' at each one's end: "
              + ", ".join(f"{label} {n} samples" for label, n in samples.items()))
    print(f"{'variant':>16} | {'loop s':>7} | {'samples/s':>9} | {'gen share':>9} | {'after':>6} | "
          f"vs fastest TRL | vs TRL same precision")
    for v in runs:
        rs = results[(seed, v.label)]
        rate = rates[v.label]
        share = median([r["gen_s"] / r["train_s"] for r in rs])
        accs = [r["accuracy_after"] for r in rs if r["accuracy_after"] is not None]
        acc = f"{median(accs):6.1%}" if accs else f"{'n/a':>6}"
        chosen = {d for r in rs for d in r.get("engine_dtypes", ())}  # what gen.dtype=auto chose on this CPU
        low = v.bf16 if v.side == "trl" else bool(chosen - {"float32"}) if chosen else \
            v.gen_dtype not in ("", "float32", "fp32")
        peer = [rates[t.label] for t in trls if t.bf16 == low]
        same = f"{rate / max(peer):.2f}x" if peer else "-"
        print(f"{v.label:>16} | {loop[v.label]:7.1f} | {rate:9.1f} | {share:9.0%} | {acc} | "
              f"{rate / fastest:13.2f}x | {same}")
    for v in runs:  # --curve: every round's points, and each runner's time to its target's final accuracy
        for i, r in enumerate(results[(seed, v.label)]):
            if r.get("curve"):
                print(f"  curve {v.label} round {i + 1}: {curve_text(r['curve'])}")
    for v, t in reach_pairs(runs):
        for i, r in enumerate(results[(seed, v.label)]):
            peer = results[(seed, t.label)][i]
            if r.get("curve") and peer.get("curve"):
                print(f"  round {i + 1}: " + reach_line(v.label, r["curve"], t.label, peer["curve"]))


def reach_pairs(runs: list[Variant]) -> list[tuple[Variant, Variant]]:
    """``(runner, target)`` pairs whose time to accuracy is printed: each areal-flow variant against
    each TRL variant of sampling offset 0, and each TRL variant of offset > 0 (the control: the same
    trainer, other samples) against its offset-0 twin."""
    base = [t for t in runs if t.side == "trl" and t.rng == 0]
    pairs = [(v, t) for v in runs if v.side == "areal" for t in base]
    return pairs + [(t, b) for t in runs if t.side == "trl" and t.rng for b in base
                    if (b.threads, b.bf16, b.malloc) == (t.threads, t.bf16, t.malloc)]


def tally(runs: list[Variant], results: dict) -> None:
    """Across every seed and round run (``--curve``): for each pair of :func:`reach_pairs`, in how
    many the runner reached the target's final held-out accuracy within the target's training time
    (a TRL twin, as fast by construction: by the target's last step), and the mean over them of
    the runner's best accuracy within that time less the target's final (points of accuracy). A
    TRL-vs-TRL pair says how often the criterion passes by chance for a trainer as good and as fast."""
    print("\ntime to accuracy over all seeds and rounds (reached within the target's training time, a TRL twin "
          "by its last step; mean of the best accuracy within it minus the target's final):")
    for v, t in reach_pairs(runs):
        won, gaps, none = 0, [], 0
        for (seed, label), rs in results.items():
            if label != v.label:
                continue
            for r, peer in zip(rs, results[(seed, t.label)]):
                if not (r.get("curve") and peer.get("curve")):
                    continue
                steps, limit, target = peer["curve"][-1]
                inside = (lambda p: p[1] <= limit) if v.side == "areal" else (lambda p: p[0] <= steps)  # noqa: B023
                hit = first_reaching(r["curve"], target)
                won += hit is not None and inside(hit)
                within = [p[2] for p in r["curve"] if inside(p)]
                if within:
                    gaps.append(max(within) - target)
                none += not within
        if gaps or none:
            mean = f"{100 * statistics.fmean(gaps):+.1f} points on average" if gaps else "-"
            print(f"  {v.label} -> {t.label}'s final: {won} of {len(gaps) + none}; best within its time {mean}"
                  + (f" ({none} with no point within it, left out of the mean)" if none else ""))
