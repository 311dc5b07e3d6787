"""What every scheduler shares around its workers: :class:`RunSetup`.

Owns the run folder's start (a new run's empty folder, or a resumed run's own,
``runtime.run_dir``, ``runtime.checkpoint``; whether a resume runs the same program:
``runtime.resume_program``), ``plan.json``, the version-0 models
(``runtime.model_source.prepare_models``), held-out accuracy before and after RL, the
router over the dataset (``runtime.router``), the workers' specs, the logger and the
summary. The schedulers that start the workers are ``runtime.launch`` (local) and
``runtime.ray_scheduler``.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from areal_flow.tasks.held_out import check_held_out
from compiler.plan import Plan
from runtime.channel_auth import new_secret
from runtime.checkpoint import Checkpoint, resume_point
from runtime.faults import check_kill_at
from runtime.executors.episode_failures import LOG_NAME
from runtime.metrics import RunLogger, episode_summary, format_summary
from runtime.preflight import check_runnable, preflight
from runtime.restarts import say
from runtime.resume_program import RUNTIME_ONLY, check_resumable, program
from runtime.router import Router
from runtime.spares import SparePrompts
from runtime.run_dir import fresh_run_dir, prune_old_runs, record_start, rewind_run_dir
from runtime.topology import Topology, build_topology
from runtime.trace import TraceRecorder, merge_trace
from runtime.workers import WorkerSpec


@dataclass
class RunSetup:
    """The parts of a run every scheduler shares, around its workers."""

    plan: Plan
    topo: Topology
    out_dir: Path
    show_progress: bool = True
    task: object = None
    folders: dict = field(default_factory=dict)
    test_set: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    secret: bytes = field(default_factory=new_secret, repr=False)
    """The run's channel secret (``runtime.channel_auth``): drawn here, given to every worker."""
    checkpoint: Checkpoint | None = None
    """Where a resumed run continues from (None: version 0)."""

    @classmethod
    def create(cls, plan: Plan, show_progress: bool = True, resume: str = "",
               config_yaml: str | None = None) -> "RunSetup":
        """Check the topology and the inputs (``runtime.preflight``), start an empty run folder
        (an earlier run's is moved aside, older ones beyond ``keep_old_runs`` deleted:
        ``runtime.run_dir``) and write ``plan.json`` (no model is touched: cheap); or, to
        resume (``run``), find the checkpoint in the run's own folder and keep the folder.
        Either way the start is recorded with ``config_yaml`` (``run_dir.record_start``).

        Raises:
            ResumeError: ``resume`` names another folder, one without a complete checkpoint, a
                folder whose ``plan.json`` is another program.
            compiler.executable.ExecutableError: a strategy the runtime cannot run (:func:`check_runnable`).
        """
        from compiler import format_table

        topo = build_topology(plan)
        check_kill_at(plan, topo)
        task = preflight(plan, topo)
        check_runnable(plan, topo)  # the shape-free rules now; prepare() adds the models' shapes
        out_dir = Path(plan.run["out_dir"]).resolve() / plan.run["name"]
        checkpointing = any(n.attrs.get("checkpoint_every") for n in topo.train_steps)
        if resume == "auto" and not checkpointing:
            print("areal-flow: warning: resume=auto without train.checkpoint_every: this run writes no checkpoint, "
                  "so it can never be resumed", file=sys.stderr)
        checkpoint = resume_point(resume, out_dir, say=say)
        if checkpoint is not None:
            reshards = check_resumable(plan, out_dir, checkpoint)
            if checkpoint.version >= topo.steps:  # complete: runtime.launch says so alone; nothing is written
                return cls(plan, topo, out_dir, show_progress, task=task, checkpoint=checkpoint)
            before = program(json.loads((out_dir / "plan.json").read_text()), RUNTIME_ONLY, placement=False)
            if before != program(json.loads(plan.to_json()), RUNTIME_ONLY, placement=False):
                (out_dir / "plan.json").write_text(plan.to_json())  # more steps, another allocation: the plan it runs
            print(f"areal-flow: resuming {out_dir} from {checkpoint.folder.name} (step {checkpoint.version} of "
                  f"{topo.steps})", file=sys.stderr)
            for line in reshards:
                print(f"areal-flow: {line}", file=sys.stderr)
        else:
            moved = fresh_run_dir(out_dir)
            if moved is not None:
                print(f"areal-flow: {out_dir} held an earlier run; moved it to {moved.name}", file=sys.stderr)
            keep = plan.run.get("keep_old_runs", 3)
            pruned = prune_old_runs(out_dir, keep)
            if pruned:
                print(f"areal-flow: deleted {len(pruned)} older run folder(s) beyond keep_old_runs={keep}: "
                      f"{', '.join(p.name for p in pruned)}", file=sys.stderr)
            (out_dir / "plan.json").write_text(plan.to_json())
        record_start(out_dir, config_yaml)
        from compiler.device_check import device_mismatch_warning

        if show_progress:
            print(format_table(plan))
            for note in topo.notes:
                print(f"note: {note}")
        warning = device_mismatch_warning(plan.cluster["gpu"])
        if warning:
            print(f"areal-flow: warning: {warning}", file=sys.stderr)
        return cls(plan, topo, out_dir, show_progress, task=task, checkpoint=checkpoint)

    def logger(self, rewind: bool = False) -> RunLogger:
        """TensorBoard (and W&B when ``logging.wandb``) + progress bar for this run; with
        ``rewind`` (a resume, or workers restarted) the run folder is first rewound to
        :attr:`checkpoint` (version 0 without one) and the events continue from its step."""
        from types import SimpleNamespace

        version = self.checkpoint.version if self.checkpoint else 0
        kept = rewind_run_dir(self.out_dir, version) if rewind else None
        wandb = SimpleNamespace(**self.plan.run["logging"]) if self.plan.run.get("logging") else None
        logger = RunLogger(self.out_dir, self.topo.steps, self.show_progress, wandb=wandb,
                           run_name=self.plan.run["name"], config={"plan_id": self.plan.id, **self.plan.run},
                           first_step=version if rewind else None)
        if kept is not None:  # the summary counts the samples trained before the checkpoint too
            logger.samples, logger.staleness = kept
            logger.earlier_samples = logger.samples
        return logger

    @property
    def eval_enabled(self) -> bool:
        return bool(self.plan.run["eval"].get("enabled", True))

    def prepare(self) -> None:
        """Version-0 models, and held-out greedy accuracy before RL."""
        from runtime.model_source import prepare_models

        self._say(f"preparing the start models ({', '.join(sorted({m['spec'] for m in self.plan.models.values()}))})")
        self.folders = prepare_models(self.plan, self.task, progress=self.show_progress)
        policy = self.topo.generate.model
        check_runnable(self.plan, self.topo, self.folders)
        self._check_token_budget()
        self.extra = {"out_dir": str(self.out_dir), "initial_model": self.folders[policy], "plan_id": self.plan.id}
        if self.eval_enabled:
            check_held_out(getattr(self.task, "name", ""), self.plan.run["eval"]["n_test"])  # names eval.n_test (an edited plan)
            self.test_set = self.task.test_set(self.plan.run["eval"]["n_test"])
            self._say(f"held-out evaluation before RL ({len(self.test_set)} problems)")
            self._held_out(self.folders[policy], "before")
            if self.show_progress:
                print(f"held-out {self.extra['eval_kind']} before RL: {self.extra['accuracy_before']:.1%} "
                      f"({len(self.test_set)} problems)")

    def _say(self, what: str) -> None:
        """One line on stderr, when it is a terminal, of what the run is doing now (start-up steps
        take seconds; in a log or pipe a bad input's error stays the one line)."""
        if self.show_progress and sys.stderr.isatty():
            print(f"areal-flow: {what}...", file=sys.stderr, flush=True)

    def _check_token_budget(self) -> None:
        """Refuse a ``train.max_tokens_per_micro_batch`` below the longest trajectory the run
        can make (before any worker starts): for ``generate``, the longest of this run's
        training prompts in tokens (``encode_prompt``, as the generator feeds them) +
        ``max_new_tokens``; for ``rollout``, the episode's ``max_context`` tokens.

        Raises:
            ConfigError: names ``train.max_tokens_per_micro_batch``, the train_step node and the
                needed minimum (tokens).
        """
        from areal_flow.config import ConfigError

        budgets = [(n.name, n.attrs.get("max_tokens_per_micro_batch", 0)) for n in self.topo.train_steps]
        budgets = [(name, b) for name, b in budgets if b]
        if not budgets:
            return
        gen = self.topo.generate
        folder = self.folders[gen.model]
        if gen.multi_turn:
            from compiler.plan import decode_value
            from runtime.executors.rollout import episode_context

            longest, what = episode_context(decode_value(gen.attrs), folder), "the episode's max_context"
        else:
            from areal_flow.models.tokenizer import load_tokenizer
            from areal_flow.ops.generate import encode_prompt

            tokenizer = load_tokenizer(folder)
            problems = self.task.train_problems(self.topo.steps * self.topo.batch_groups, seed=self.plan.run["seed"] + 1)
            prompt = max(len(encode_prompt(tokenizer, p["prompt"], gen.attrs.get("chat_template"))) for p in problems)
            longest = prompt + gen.attrs["max_new_tokens"]
            what = f"the longest training prompt ({prompt} tokens) + gen.max_new_tokens ({gen.attrs['max_new_tokens']})"
        for name, budget in budgets:
            if budget < longest:
                raise ConfigError(f"train.max_tokens_per_micro_batch={budget} (train_step '{name}') is below "
                                  f"{what} = {longest} tokens; set it to at least {longest}, or 0 (off)")

    def _held_out(self, folder, when: str) -> None:
        """``accuracy_<when>`` on the held-out set (and the answer kinds, or for episodes of a
        rollout node ``episodes_<when>``: return, turns, env info means)."""
        gen = self.topo.generate
        temperature = float(self.plan.run["eval"].get("temperature", 0.0))
        sampled = f"sampled at temperature {temperature:g}" if temperature else "greedy"
        self.extra["eval_kind"] = f"episode success rate ({sampled})" if gen.multi_turn else "greedy accuracy"
        if gen.multi_turn:
            from compiler.plan import decode_value
            from runtime.evaluate import evaluate_episodes
            from runtime.executors.rollout import episode_context
            from runtime.model_source import load_pretrained

            attrs = decode_value(gen.attrs)
            model, tokenizer = load_pretrained(folder)
            stats = evaluate_episodes(model, tokenizer, attrs, self.test_set,
                                      temperature=temperature,
                                      max_context=episode_context(attrs, folder),
                                      failure_log=self.out_dir / LOG_NAME)
            self.extra[f"accuracy_{when}"] = stats.pop("accuracy")
            self.extra[f"episodes_{when}"] = stats
            return
        self.extra[f"accuracy_{when}"], kinds = _evaluate(folder, self.task, self.test_set,
                                                          gen.attrs.get("chat_template"))
        if kinds:
            self.extra[f"answer_kinds_{when}"] = kinds

    def router(self, replicas: list[str], control: str) -> Router:
        """The router over the dataset's prompts (a resampled slot's prompt by its index and
        attempt, ``runtime.spares``), admitting from the checkpoint's ``next_index`` when resuming (the dataset's cursor:
        prompt ``i`` is ``problems[i]``, so every epoch and order is the uninterrupted run's)."""
        n = self.topo.steps * self.topo.batch_groups
        seed = self.plan.run["seed"]
        problems = self.task.train_problems(n, seed=seed + 1)
        filters = [n_.max_attempts for n_ in self.plan.nodes if n_.max_attempts is not None]  # nodes that drop groups
        spares = SparePrompts(self.task, n, max(filters, default=2) - 1, seed)
        trace = TraceRecorder.for_plan(self.plan, self.out_dir, "driver")
        return Router(problems, spares, self.topo.max_staleness, self.topo.batch_groups,
                      replicas, control, trace, admission_edge=f"{self.topo.dataset.name}->{self.topo.generate.name}",
                      secret=self.secret, first_index=self.checkpoint.manifest()["next_index"] if self.checkpoint else 0)

    def merge_trace(self) -> None:
        """Merge the workers' spans into ``trace.json`` (``runtime.trace``), on success or failure;
        its path goes into the summary."""
        path = merge_trace(self.out_dir) if self.plan.run.get("logging", {}).get("trace", True) else None
        if path is not None:
            self.extra["trace"] = str(path)

    def specs(self, addresses: dict[str, list[str]], control: str, threads: int) -> list[WorkerSpec]:
        """One spec per worker process: ``addresses[group]`` are its workers' inboxes, and for
        the generation group also ``addresses["weights"]`` its replicas' weight channels."""
        specs = []
        common = dict(plan=self.plan, folders=self.folders, out_dir=str(self.out_dir), control=control,
                      threads=threads, secret=self.secret)
        trainer = addresses[self.topo.trainer.name][0]
        version = self.checkpoint.version if self.checkpoint else 0
        for g in self.topo.groups.values():
            downstream = {d: addresses[d][0] for d in g.downstream}
            # resumed: replicas wait for the checkpoint's version from the trainer, which loads it
            resume = dict(resume_version=version, resync=trainer if version else "", trainer=trainer) \
                if g.kind == "generation" \
                else dict(resume=str(self.checkpoint.folder) if self.checkpoint and g.batch_nodes else "")
            for r in range(g.replicas):
                specs.append(WorkerSpec(group=g.name, rank=r, inbox=addresses[g.name][r], downstream=downstream,
                                        weights=addresses["weights"][r] if g.kind == "generation" else "",
                                        routes={ts: addresses["weights"] for ts, _ in self.topo.routes
                                                if ts in g.nodes}, **resume, **common))
        return specs

    def finish(self, logger: RunLogger, workers: dict, **extra) -> dict:
        """Close ``logger``, measure held-out accuracy after RL, write and return the summary."""
        logger.close()
        self.extra.update(model_dir=str(self.out_dir / "model"), trajectories=str(self.out_dir / "trajectories"),
                          workers=workers, **extra)
        episodes = episode_summary(workers, self.out_dir / LOG_NAME)
        if episodes:
            self.extra["episodes"] = episodes
        if self.eval_enabled:
            self._held_out(self.out_dir / "model", "after")
        summary = logger.summary(**self.extra)
        if self.show_progress:
            print(format_summary(summary))
        return summary


def _evaluate(folder, task, problems: list[dict], chat_template) -> tuple[float, dict | None]:
    """Held-out greedy accuracy of the policy in ``folder``, and the count of each
    ``task.answer_kind`` (None when the task does not classify its answers)."""
    from runtime.evaluate import answer_accuracy, greedy_answers
    from runtime.model_source import load_pretrained

    model, tokenizer = load_pretrained(folder)
    answers = greedy_answers(model, tokenizer, task, problems, chat_template=chat_template)
    accuracy = answer_accuracy(task, answers, problems)
    if not hasattr(task, "answer_kind"):
        return accuracy, None
    kinds = Counter(task.answer_kind(p, text) for text, p in zip(answers, problems))
    return accuracy, {kind: kinds[kind] for kind in task.ANSWER_KINDS}
