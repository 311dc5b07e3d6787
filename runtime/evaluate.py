"""Held-out evaluation: greedy accuracy and pass@k of a policy on task problems.

Owns the evaluation a run does before and after RL (``greedy_answers``,
``answer_accuracy``) and the stand-alone one behind ``areal-flow eval`` (``evaluate_model``
of the model a run starts from, ``start_of_run``, or of a model under a config on its
task, ``eval_task``: a JSON-able result), and the held-out episodes of a rollout node
(``play_episodes``). Must not train or change the model.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from areal_flow.dtypes import model_dtype
from areal_flow.ops.generate import encode_prompt
from areal_flow.types import Trajectory
from runtime.engines.generation import GenerationEngine, GenerationRequest, SamplingParams


def greedy_answers(
    engine_or_model, tokenizer, task, problems: list[dict], max_batch_size: int = 128, chat_template: bool | None = None
) -> list[str]:
    """The greedy (temperature 0) completion text of every problem, in order, special
    tokens removed (so the text up to EOS is the whole text when generation stopped).

    Args:
        engine_or_model: an idle ``GenerationEngine``, or a causal LM (wrapped in a
            fresh engine of ``max_batch_size`` rows; the model is put in eval mode).
        tokenizer: encodes prompts (``ops.generate.encode_prompt``) and supplies EOS.
        task: its ``max_answer_tokens`` bounds the completion (16 new tokens when absent).
        problems: dicts with ``"prompt"``.
        chat_template: as ``ops.generate(chat_template=...)``; None = when the tokenizer
            has a chat template (what the rollout worker does by default).

    Raises:
        RuntimeError: the engine has requests in flight.
        ValueError: ``chat_template=True`` and the tokenizer has none.
    """
    if not problems:
        return []
    engine = engine_or_model
    if not isinstance(engine, GenerationEngine):
        engine = GenerationEngine(engine_or_model, tokenizer, max_batch_size=max_batch_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=getattr(task, "max_answer_tokens", 16))
    requests = [GenerationRequest(f"eval-{i}", encode_prompt(tokenizer, p["prompt"], chat_template), params)
                for i, p in enumerate(problems)]
    with torch.inference_mode():
        return [r.output_text for r in engine.generate(requests)]


def greedy_accuracy(
    engine_or_model, tokenizer, task, problems: list[dict], max_batch_size: int = 128, chat_template: bool | None = None
) -> float:
    """Fraction of ``problems`` whose greedy completion (``greedy_answers``, same
    arguments) earns ``task.reward(output_text, problem["answer"]) == 1``; ``0.0`` for an
    empty list. Raises as ``greedy_answers``."""
    return answer_accuracy(task, greedy_answers(engine_or_model, tokenizer, task, problems, max_batch_size,
                                                chat_template), problems)


def answer_accuracy(task, answers: list[str], problems: list[dict]) -> float:
    """Mean ``task.reward(answer, problem["answer"])`` over paired ``answers`` and
    ``problems``; ``0.0`` for empty lists."""
    scores = [task.reward(text, p["answer"]) for text, p in zip(answers, problems)]
    return sum(scores) / len(scores) if scores else 0.0


EVAL_TASKS = ("arithmetic", "gsm8k", "longtail")
"""The ``dataset.name`` tasks whose answers a rule judges: ``areal-flow eval --task``; and
every ``reasoning_gym:<dataset>`` (:func:`judged`)."""


def judged(name: str) -> bool:
    """Whether a rule judges the answers of task ``name`` (:data:`EVAL_TASKS` or reasoning-gym's)."""
    return name in EVAL_TASKS or str(name).startswith("reasoning_gym:")

ENV_TASKS = ("support_desk", "guess_number")
"""The ``dataset.name`` tasks whose episodes an env scores (no single answer to judge)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct.

    Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (arXiv:2107.03374),
    eq. 1: ``pass@k = 1 - C(n - c, k) / C(n, k)``, computed as the product
    ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (their numerically stable form); 1.0 when
    ``n - c < k`` (every k-subset holds a correct sample).

    Raises:
        ValueError: not ``0 <= c <= n`` or not ``1 <= k <= n``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def sampled_correct(engine, tokenizer, task, problems: list[dict], n_samples: int, temperature: float = 1.0,
                    top_p: float = 1.0, chat_template: bool | None = None) -> list[int]:
    """Correct samples per problem: ``n_samples`` completions each (``temperature``,
    ``top_p``, up to ``task.max_answer_tokens``), scored by ``task.reward == 1``.

    Returns:
        ``[c_0, c_1, ...]``, one count in ``[0, n_samples]`` per problem, in order.

    Raises:
        ValueError: ``temperature <= 0`` (greedy samples are all equal; use ``greedy_answers``).
    """
    if temperature <= 0:
        raise ValueError(f"sampled_correct: temperature must be > 0 for pass@k, got {temperature}")
    params = SamplingParams(temperature=temperature, top_p=top_p,
                            max_new_tokens=getattr(task, "max_answer_tokens", 16))
    requests = [GenerationRequest(f"s-{i}-{j}", encode_prompt(tokenizer, p["prompt"], chat_template), params,
                                  meta={"i": i}) for i, p in enumerate(problems) for j in range(n_samples)]
    counts = [0] * len(problems)
    with torch.inference_mode():
        for result in engine.generate(requests):
            i = result.meta["i"]
            counts[i] += task.reward(result.output_text, problems[i]["answer"]) == 1
    return counts


def eval_task(cfg):
    """The task ``areal-flow eval`` scores on: the one a run with config ``cfg`` trains on and
    evaluates with (``areal_flow.ops.dataset.build_task`` of ``cfg.dataset`` and ``cfg.seed``:
    the same test set, and the same warm start of a tiny preset).

    Raises:
        ValueError: ``dataset.name`` is no task, or one whose answers no rule judges (an env
            task: its episodes are scored by a run's held-out episode success rate).
    """
    import dataclasses

    from areal_flow.tasks.catalog import build_task

    name, known = cfg.dataset.name, ", ".join(EVAL_TASKS) + " or reasoning_gym:<dataset>"
    if name in ENV_TASKS:
        raise ValueError(f"task {name!r} is an env task: a run scores its episodes (held-out episode success rate); "
                         f"areal-flow eval scores the answers of {known}")
    if not judged(name):
        hint = {"arith": "; arith is 'arithmetic'", "arith-chat": "; arith-chat is 'arithmetic' with "
                "dataset.prompt_style=chat"}.get(name, "")
        raise ValueError(f"task {name!r}: the task names are dataset.name's: {known}{hint}")
    return build_task(dataclasses.asdict(cfg.dataset), cfg.seed)


def start_of_run(plan, progress: bool = True) -> tuple[Path, object]:
    """What a run of ``plan`` starts from: its policy's version-0 folder and its dataset's task,
    made as the run makes them (``RunSetup.prepare``: ``build_task`` of the dataset node and
    the run's seed, ``runtime.model_source.prepare_models`` under ``plan.run["warm_start"]``,
    so a tiny preset's warm start is the run's, from the same cache).

    Raises:
        ValueError: the dataset is an env task (as :func:`eval_task`); the loaders' errors.
    """
    from areal_flow.tasks.catalog import build_task
    from runtime.model_source import prepare_models

    source = next(n for n in plan.nodes if n.grain == "source")
    name = source.attrs.get("name", "arithmetic")
    if not judged(name):
        raise ValueError(f"task {name!r} is an env task: a run scores its episodes (held-out episode success rate); "
                         f"areal-flow eval scores the answers of {', '.join(EVAL_TASKS)} or reasoning_gym:<dataset>")
    task = build_task(source.attrs, plan.run["seed"])
    policy = next(n for n in plan.nodes if n.grain == "stream").model
    return Path(prepare_models(plan, task, progress=progress, names=[policy])[policy]), task


def evaluate_model(folder: str | Path, task, *, model: str, n: int = 500, samples: int = 0, temperature: float = 1.0,
                   dtype: str = "float32", chat_template: bool | None = None, max_batch_size: int = 64,
                   progress: bool = True) -> dict:
    """Greedy accuracy (pass@1 at temperature 0) and, with ``samples = k >= 1``, sampled
    pass@1..pass@k (``pass_at_k``, averaged over problems) of the model in ``folder`` on the
    first ``n`` test problems of ``task`` (:func:`eval_task`, :func:`start_of_run`).

    Args:
        folder: a ``transformers`` folder (:func:`start_of_run`,
            ``runtime.model_source.prepare_initial_model``).
        model: what the result names as the model (the spec or graph file given).
        n: test problems (fewer if the test split is smaller).
        samples: completions per problem for pass@k; 0 = greedy only.
        temperature: sampling temperature of the pass@k samples.
        dtype: ``model.dtype`` of the weights (``auto``: as a CPU trainer here would choose).
        chat_template: as the generate node's (None: when the tokenizer has one).
        progress: show a tqdm bar over batches of problems.

    Returns:
        ``{"model", "folder", "task", "n", "greedy_accuracy", "samples", "temperature",
        "pass_at_k": {"1": ..., "k": ...}, "wall_s"}`` (pass@k for k = 1, 2, 4, ..., samples).

    Raises:
        ValueError: ``n < 1`` or ``samples < 0``; more problems than a generated task keeps out of
            training (``areal_flow.tasks.held_out.check_held_out``); OSError: the folder cannot be loaded.
    """
    from areal_flow.tasks.held_out import check_held_out
    from runtime.engines.precision import autocast_bf16_speedup
    from runtime.model_source import load_pretrained

    if n < 1 or samples < 0:
        raise ValueError(f"--n must be >= 1 and --samples >= 0, got n={n}, samples={samples}")
    check_held_out(task.name, n, "--n (or eval.n_test)")
    start = time.perf_counter()
    model_, tokenizer = load_pretrained(folder, model_dtype(dtype, "cpu", bf16_speedup=autocast_bf16_speedup))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    engine = GenerationEngine(model_, tokenizer, max_batch_size=max_batch_size)
    problems = task.test_set(n)
    chunk = max(1, max_batch_size // max(1, samples))
    greedy, counts = [], []
    name = task.name
    bar = tqdm(total=len(problems), desc=f"eval {name}", unit="problem", disable=not progress)
    for first in range(0, len(problems), chunk):
        part = problems[first:first + chunk]
        greedy += greedy_answers(engine, tokenizer, task, part, chat_template=chat_template)
        if samples:
            counts += sampled_correct(engine, tokenizer, task, part, samples, temperature, chat_template=chat_template)
        bar.update(len(part))
    bar.close()
    ks = sorted({1, samples, *[2 ** e for e in range(1, 12) if 2 ** e < samples]}) if samples else []
    return {
        "model": model, "folder": str(Path(folder)), "task": name, "n": len(problems),
        "greedy_accuracy": answer_accuracy(task, greedy, problems), "samples": samples,
        "temperature": temperature if samples else 0.0,
        "pass_at_k": {str(k): sum(pass_at_k(samples, c, k) for c in counts) / len(counts) for k in ks},
        "wall_s": round(time.perf_counter() - start, 2),
    }


def evaluate_episodes(model, tokenizer, attrs: dict, rows: list[dict], *, temperature: float = 0.0,
                      max_context: int, seed: int = 0, failure_log=None) -> dict:
    """Held-out episodes of ``model`` for a rollout node: one episode per row, sampled at
    ``temperature`` (0 = greedy) on the embedded engine.

    Args:
        attrs: the rollout node's attributes (env or agent, ``max_turns``, ``gamma``, ...).
        rows: the held-out dataset rows.
        max_context: tokens of prompt + turns at most.
        failure_log: where the first traceback of each distinct episode error goes (a path;
            ``runtime.executors.episode_failures``; None: nowhere).

    Returns:
        ``{"accuracy": fraction of rows whose episode the env reported a ``success`` (or
        ``resolved``) > 0 for (agent episodes: a return > 0), "return": mean discounted
        return, "turns": mean policy turns, "env/<key>": mean per episode of each numeric
        info key, "failed": episodes that failed}``.
    """
    from runtime.engines.generation import GenerationEngine
    from runtime.executors.episode_runner import episode_correct

    engine = GenerationEngine(model, tokenizer, max_batch_size=min(64, max(1, len(rows))), seed=seed)
    trajs = play_episodes(engine, tokenizer, {**attrs, "temperature": temperature, "top_p": 1.0}, rows, max_context,
                          failure_log)
    n = max(len(trajs), 1)

    def success(t) -> bool:  # as training judges an episode; an env that reports no success: not one
        return bool(episode_correct(t.meta.get("env", {}), t.reward, attrs.get("agent") is not None))

    out = {"accuracy": sum(success(t) for t in trajs) / max(len(rows), 1),
           "return": sum(float(t.reward) for t in trajs) / n, "turns": sum(t.meta["turns"] for t in trajs) / n,
           "failed": len(rows) - len(trajs)}
    for key in sorted({k for t in trajs for k in t.meta.get("env", {})}):
        out[f"env/{key}"] = sum(t.meta["env"].get(key, 0.0) for t in trajs) / n
    return out


def play_episodes(engine, tokenizer, attrs: dict, rows: list[dict], max_context: int,
                  failure_log: Path | None = None) -> list[Trajectory]:
    """Play one episode per row to the end (held-out evaluation); trajectories in row order
    (failed episodes left out and counted, never stopping the evaluation: no failure budget;
    ``failure_log`` as ``runtime.executors.episode_runner.EpisodeRunner``'s)."""
    from runtime.executors.episode_runner import EpisodeRunner

    runner = EpisodeRunner(engine, tokenizer, {**attrs, "n_samples": 1, "max_failure_fraction": 1.0}, SamplingParams(
        temperature=attrs["temperature"], top_p=attrs["top_p"], max_new_tokens=attrs["max_new_tokens"]), max_context,
        failure_log)
    finished: dict[int, list[Trajectory]] = {}
    try:
        for i, row in enumerate(rows):
            runner.submit(i, 1, row)
        while runner.has_work():
            finished.update((index, trajs) for index, _, trajs in runner.step())
    finally:
        runner.close()
    return [t for i in range(len(rows)) for t in finished[i]]

