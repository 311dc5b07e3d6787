"""Tasks from reasoning-gym: any of its procedural datasets as a ``dataset.name``, scored
by the dataset's own ``score_answer``.

Owns the adapter between reasoning-gym (Stojanovski et al. 2025, "Reasoning Gym:
Reasoning Environments for Reinforcement Learning with Verifiable Rewards",
arXiv:2505.24760; the ``reasoning-gym`` package, Apache-2.0) and the task interface of
``areal_flow.ops.dataset``. ``dataset.name: reasoning_gym:<task>`` (e.g.
``reasoning_gym:leg_counting``) names a dataset of ``reasoning_gym.create_dataset``;
``dataset.options`` are the keyword arguments of that dataset's config class
(``min_terms: 2`` ...), ``size`` and ``seed`` excepted (the run sets them).

A mix of datasets is reasoning-gym's own ``composite`` dataset: ``dataset.name:
reasoning_gym:composite`` with ``dataset.options: {datasets: [{name: chain_sum, weight: 1,
config: {...}}, ...]}`` (each entry drawn from one of them with probability proportional
to its weight; :func:`composite_specs` checks every entry as a dataset of its own); each
row's entry names its ``metadata.source_dataset``, and the composite's ``score_answer``
scores it with that dataset's.

A row is ``{"prompt": entry["question"], "answer": <reference>, "target":
entry["answer"], "id": int}``. The reference is JSON ``{"task", "options", "entry"}``: the
whole entry (question, oracle answer, metadata) travels with every trajectory as its
``answer``, so :func:`reward` can call ``score_answer(answer=..., entry=...)`` in any
process without regenerating the dataset. ``target`` is the oracle answer as text (what a
supervised warm start imitates, ``runtime.engines.sft``; with ``warm_start.teacher_bug_rate``
the two-term ``+``/``-`` entries' targets may be a buggy teacher's instead,
:meth:`ReasoningGymTask.demonstrations`). Tuples in the metadata are tagged
(``{"__tuple__": [...]}``) so they come back as tuples (ARC scorers compare a parsed board,
a tuple of tuples, with ``==``); other non-JSON values become their ``str``.
``tests/test_rgym.py`` checks, for every registered dataset, that scores of the decoded
entry equal those of the original.

Answers are extracted as reasoning-gym's own evaluation extracts them
(``reasoning_gym.utils.extract_answer``: the last ``<answer>...</answer>``, stripped);
a reply without the tag is scored whole (cut at ``<eos>``, stripped), which suits a
model prompted or warm-started to answer with just the answer. ``dataset.prompt_style:
chat`` puts reasoning-gym's default system prompt (``SYSTEM_PROMPTS["default"]``: think
step by step, then ``<answer>answer here</answer>``) before the question, for a chat model
(``ops.generate`` renders the prompt as one user turn).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import random
import re
import zlib

from areal_flow.tasks.arithmetic import buggy_answer
from areal_flow.tasks.held_out import TEST_ID_OFFSET

PREFIX = "reasoning_gym:"
"""``dataset.name`` of a reasoning-gym task is ``PREFIX + <dataset name>``."""
RESERVED = ("seed", "size")
"""Config keys the run sets (per draw), not ``dataset.options``."""
COMPOSITE = "composite"
"""reasoning-gym's mixing dataset (module doc)."""
_TWO_TERMS = re.compile(r"(\d+)\s*([+-])\s*(\d+)")


def _rg():
    try:
        import reasoning_gym
    except ImportError:
        raise ModuleNotFoundError("reasoning-gym tasks need the 'reasoning-gym' package: "
                                  "pip install reasoning-gym (or pip install -e '.[dev]')") from None
    return reasoning_gym


def task_names() -> list[str]:
    """The names of every dataset reasoning-gym registers, sorted (``leg_counting``, ...).

    Raises:
        ModuleNotFoundError: reasoning-gym is not installed (names the pip command).
    """
    _rg()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_task(name: str, options: dict | None = None) -> None:
    """Refuse a reasoning-gym dataset name or options that ``create_dataset`` would refuse.

    Args:
        name: the dataset name, without :data:`PREFIX`.
        options: keyword arguments of its config class.

    Raises:
        ValueError: an unknown name (the three closest names listed, else how to list them),
            options that are not a dict, name ``seed``/``size``, are no field of the config
            class (its fields listed), or fail the config's own ``validate``.
        ModuleNotFoundError: reasoning-gym is not installed.
    """
    names = task_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(PREFIX + c for c in close)}?" if close else \
            f"{len(names)} known, e.g. {', '.join(names[:5])} (reasoning_gym.factory.DATASETS)"
        raise ValueError(f"dataset.name={PREFIX + name!r}: reasoning-gym has no dataset {name!r}; {hint}")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise ValueError(f"dataset.options={options!r}: expected a mapping of {name}'s config keys")
    from reasoning_gym.factory import DATASETS

    if name == COMPOSITE:
        composite_specs(options)
    fields = [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in RESERVED]
    bad = [k for k in options if k not in fields]
    if bad:
        raise ValueError(f"dataset.options: {name} has no config key {', '.join(map(repr, bad))}"
                         f"{' (the run sets seed and size)' if set(bad) & set(RESERVED) else ''}; "
                         f"its keys: {', '.join(fields)}")
    try:
        _dataset(name, json.dumps(options, sort_keys=True), 0, 1)
    except Exception as exc:  # noqa: BLE001 - a config's validate() raises AssertionError, ValueError, ...
        raise ValueError(f"dataset.options={options!r}: reasoning-gym's {name} refuses them "
                         f"({type(exc).__name__}: {exc})") from None


def composite_specs(options: dict) -> list:
    """The ``datasets`` of a ``composite``'s options as reasoning-gym's ``DatasetSpec`` list.

    Args:
        options: ``{"datasets": [{"name": <dataset>, "weight": w (default 1), "config":
            {...} (default {})}, ...]}``.

    Raises:
        ValueError: ``datasets`` missing, empty or not a list; an entry that is not a
            mapping, has other keys, repeats a name, names ``composite`` or a weight that
            is not a number > 0; an entry's name or config that :func:`check_task` refuses
            (the message names ``dataset.options.datasets[i]``).
    """
    from reasoning_gym.composite import DatasetSpec

    specs = options.get("datasets") if isinstance(options, dict) else None
    if not isinstance(specs, list) or not specs:
        raise ValueError(f"dataset.options.datasets={specs!r}: reasoning_gym:composite needs a non-empty list of "
                         "{name, weight, config} entries, one per dataset of the mix")
    out, seen = [], set()
    for i, spec in enumerate(specs):
        where = f"dataset.options.datasets[{i}]"
        if not isinstance(spec, dict) or set(spec) - {"name", "weight", "config"} or "name" not in spec:
            raise ValueError(f"{where}={spec!r}: expected a mapping with name, weight (default 1) and config "
                             "(default {})")
        name, weight, config = spec["name"], spec.get("weight", 1.0), spec.get("config", {})
        if name == COMPOSITE or name in seen:
            raise ValueError(f"{where}: name {name!r} {'is the mix itself' if name == COMPOSITE else 'repeated'}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"{where}: weight={weight!r}, expected a number > 0")
        try:
            check_task(name, config)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        seen.add(name)
        out.append(DatasetSpec(name=name, weight=float(weight), config=dict(config)))
    return out


@functools.lru_cache(maxsize=64)
def _dataset(name: str, options_json: str, seed: int, size: int):
    """The ``create_dataset`` instance (cached: scoring needs one per task and options)."""
    options = json.loads(options_json)
    if name == COMPOSITE:
        options = {**options, "datasets": composite_specs(options)}
    return _rg().create_dataset(name, seed=seed, size=size, **options)


def _seed(*parts) -> int:
    """A 32-bit seed of ``parts``, the same in every process (``hash`` of a str is not)."""
    return zlib.crc32(":".join(map(str, parts)).encode())


def _pack(value):
    """``value`` with every tuple tagged ``{"__tuple__": [...]}`` (JSON has no tuples)."""
    if isinstance(value, tuple):
        return {"__tuple__": [_pack(v) for v in value]}
    if isinstance(value, list):
        return [_pack(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _pack(v) for k, v in value.items()}
    return value


def _unpack(obj: dict):
    """``json.loads`` object hook: the inverse of :func:`_pack`."""
    return tuple(obj["__tuple__"]) if len(obj) == 1 and "__tuple__" in obj else obj


def encode_reference(task: str, options: dict, entry: dict) -> str:
    """The reference JSON of a row (module doc), keys sorted: the same text whether ``options``
    came from the yaml or from a plan.json (which stores keys sorted), so the warm start's rows
    and their cache key do not depend on where the run's plan came from."""
    return json.dumps(_pack({"task": task, "options": options, "entry": entry}), default=str, sort_keys=True)


def extract(output_text: str) -> str:
    """The answer in a reply: the last ``<answer>...</answer>`` (reasoning-gym's
    ``extract_answer``), else the whole reply cut at ``<eos>``; stripped."""
    from reasoning_gym.utils import extract_answer

    text = str(output_text).split("<eos>", 1)[0]
    tagged = extract_answer(text)
    return text.strip() if tagged is None else tagged


def reward(output_text: str, reference: str) -> float:
    """The reasoning-gym score of a reply: ``score_answer(answer=extract(output_text),
    entry=...)`` of the dataset the reference names, in [0, 1] as the dataset defines it.

    Args:
        output_text: the policy's reply.
        reference: a row's ``answer`` (module doc: JSON ``{"task", "options", "entry"}``).

    Returns:
        the dataset's score; 0.0 when ``score_answer`` raises on the reply (policy text is
        untrusted input; a dataset's scorer may choke on garbage).

    Raises:
        ValueError: ``reference`` is not such JSON (a row not made by :class:`ReasoningGymTask`).
    """
    try:
        ref = json.loads(reference, object_hook=_unpack)
        name, options, entry = ref["task"], ref["options"], ref["entry"]
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"reasoning_gym reward: the answer is not a reasoning-gym reference "
                         f"({type(exc).__name__}: {exc}): {str(reference)[:80]!r}") from None
    dataset = _dataset(name, json.dumps(options, sort_keys=True), 0, 1)
    try:
        score = float(dataset.score_answer(answer=extract(output_text), entry=entry))
    except Exception:  # noqa: BLE001 - see Returns
        return 0.0
    return score


def buggy_target(expression) -> str | None:
    """The buggy teacher's answer to an entry's ``metadata.expression`` when it is two
    non-negative integers joined by ``+`` or ``-`` (basic_arithmetic, chain_sum):
    :func:`areal_flow.tasks.arithmetic.buggy_answer`, carries dropped and the smaller digit
    taken from the larger (``"58 + 67"`` -> ``"15"``, ``"52 - 17"`` -> ``"45"``; the right
    answer when no carry or borrow is needed); None for any other expression or none."""
    match = _TWO_TERMS.fullmatch(expression.strip()) if isinstance(expression, str) else None
    return None if match is None else str(buggy_answer(int(match.group(1)), match.group(2), int(match.group(3))))


class ReasoningGymTask:
    """One reasoning-gym dataset as a task (``dataset.name: reasoning_gym:<name>``).

    Args:
        name: the dataset name, without :data:`PREFIX`.
        seed: the run's seed; every draw's reasoning-gym seed derives from it.
        options: keyword arguments of the dataset's config (``dataset.options``).
        max_answer_tokens: greedy-evaluation budget, tokens.
        prompt_style: ``"plain"`` (the question) or ``"chat"`` (module doc).

    Raises:
        ValueError / ModuleNotFoundError: as :func:`check_task`; an unknown ``prompt_style``.

    Training and test draws come from different reasoning-gym seeds; a dataset with a small
    problem space may repeat a test question in training (no rejection, unlike arithmetic).
    """

    def __init__(self, name: str, seed: int = 0, options: dict | None = None, max_answer_tokens: int = 32,
                 prompt_style: str = "plain") -> None:
        check_task(name, options)
        if prompt_style not in ("plain", "chat"):
            raise ValueError(f"dataset.prompt_style={prompt_style!r}: expected 'plain' or 'chat'")
        self.prompt_style = prompt_style
        self.task, self.seed, self.options = name, seed, dict(options or {})
        self.name = PREFIX + name
        self.max_answer_tokens = max_answer_tokens
        self._options_json = json.dumps(self.options, sort_keys=True)

    def spec(self) -> dict:
        """The parameters that define the task's data (cache keys of the warm start)."""
        spec = {"name": self.name, "seed": self.seed, "options": self.options}
        return spec if self.prompt_style == "plain" else {**spec, "prompt_style": self.prompt_style}

    def _rows(self, n: int, rg_seed: int, first_id: int) -> list[dict]:
        if n < 0:
            raise ValueError(f"{self.name}: n must be >= 0, got {n}")
        if not n:
            return []
        dataset = _dataset(self.task, self._options_json, rg_seed, n)
        system = _rg().utils.SYSTEM_PROMPTS["default"] + "\n" if self.prompt_style == "chat" else ""
        rows = []
        for i in range(n):
            entry = dataset[i]
            rows.append({"prompt": system + entry["question"],
                         "answer": encode_reference(self.task, self.options, entry), "target": str(entry["answer"]),
                         "id": first_id + i})
        return rows

    def train_problems(self, n: int, seed: int) -> list[dict]:
        """``n`` training rows (ids ``0 .. n-1``) from reasoning-gym seed ``(self.seed, seed)``."""
        return self._rows(n, _seed("rg-train", self.task, self.seed, seed), 0)

    def demonstrations(self, n: int, seed: int, bug_rate: float = 0.0) -> list[dict]:
        """``train_problems(n, seed)`` with the targets an imperfect teacher writes (the warm
        start's ``warm_start.teacher_bug_rate``): a row whose entry is a two-term ``+``/``-``
        expression gets, with probability ``bug_rate``, :func:`buggy_target` as its ``target``
        (wrong only where a carry or borrow is needed); other rows keep the oracle answer.
        Every row's ``answer`` (the reference the reward scores) stays the entry.

        Raises:
            ValueError: ``bug_rate`` outside ``[0, 1]``, or > 0 while no row is such an expression.
        """
        if not 0.0 <= bug_rate <= 1.0:
            raise ValueError(f"bug_rate must be in [0, 1], got {bug_rate}")
        rng = random.Random(f"rg-teacher:{self.task}:{self.seed}:{seed}")
        rows, eligible = self.train_problems(n, seed), 0
        for row in rows:
            metadata = json.loads(row["answer"], object_hook=_unpack)["entry"].get("metadata") or {}
            bug = buggy_target(metadata.get("expression"))
            if bug is not None:
                eligible += 1
                if rng.random() < bug_rate:
                    row["target"] = bug
        if bug_rate and rows and not eligible:
            raise ValueError(f"{self.name}: warm_start.teacher_bug_rate={bug_rate} needs entries whose expression is "
                             "two non-negative integers joined by + or - (basic_arithmetic, chain_sum); none of "
                             f"{n} rows drawn is one; set warm_start.teacher_bug_rate=0")
        return rows

    def test_set(self, n: int = 500) -> list[dict]:
        """``n`` fixed held-out rows, ids ``TEST_ID_OFFSET + i``; ``test_set(m)``, ``m < n``,
        is a prefix of ``test_set(n)`` (a reasoning-gym entry depends on its seed and index only)."""
        return self._rows(n, _seed("rg-test", self.task, self.seed), TEST_ID_OFFSET)

    ANSWER_KINDS = ("right", "buggy procedure", "other")

    def answer_kind(self, problem: dict, output_text: str) -> str:
        """Classify one answer (the run's summary counts the held-out greedy ones): ``"right"``
        (:meth:`correct`), ``"buggy procedure"`` (the :func:`buggy_target` of a two-term entry that
        needs a carry or borrow: the warm-start teacher's misconception) or ``"other"``."""
        if self.correct(output_text, problem["answer"]):
            return "right"
        entry = json.loads(problem["answer"], object_hook=_unpack)["entry"]
        bug = buggy_target((entry.get("metadata") or {}).get("expression"))
        return "buggy procedure" if bug not in (None, str(entry["answer"])) and extract(output_text) == bug else "other"

    @staticmethod
    def reward(output_text: str, answer: str) -> float:
        """:func:`reward` (the dataset's ``score_answer``)."""
        return reward(output_text, answer)

    @staticmethod
    def correct(output_text: str, answer: str) -> bool:
        """Whether the reply scores 1.0: the run's accuracy."""
        return reward(output_text, answer) == 1.0


def parse_name(name: str) -> str | None:
    """The reasoning-gym dataset of a ``dataset.name`` (``"reasoning_gym:leg_counting"`` ->
    ``"leg_counting"``), or None for a name without :data:`PREFIX`."""
    return name[len(PREFIX):] if isinstance(name, str) and name.startswith(PREFIX) else None

