"""GSM8K grade-school math word problems: loading and reference parsing.

Owns: reading GSM8K from its JSONL files (one ``{"question": ..., "answer": ...}`` object
per line, the reference answer being the number after ``####`` on the answer's last
line) or from a ``datasets`` hub name, turning each row into a problem dict
``{"prompt": question, "answer": "72", "id": int}``, and ``GSM8KTask``, the task object
the ``dataset`` op builds (train draws, held-out test set, reward). Must not: tokenize or
apply chat templates (the prompt is the bare question); scoring is
``areal_flow.rewards.math.math_reward``.

Source: Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems"
(arXiv:2110.14168); data MIT-licensed by OpenAI, shipped in ``shared/data/gsm8k``
beside the repository (``<repo>/../shared/data/gsm8k/{train,test}.jsonl``).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from areal_flow.rewards.math import math_reward
from areal_flow.tasks.arithmetic import TEST_ID_OFFSET

_REPO_ROOT = Path(__file__).resolve().parents[2]
_SPLITS = ("train", "test")
_REFERENCE_RE = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class GSM8KConfig:
    """Where GSM8K comes from."""

    split: str = "train"
    """``"train"`` (7473 problems) or ``"test"`` (1319 problems)."""
    path: str | None = None
    """A JSONL file, or a folder holding ``<split>.jsonl``; None: the shipped copy in
    ``<repo>/../shared/data/gsm8k`` (or ``<cwd>/../shared/data/gsm8k``)."""
    hf_name: str | None = None
    """A ``datasets`` hub name (e.g. ``"openai/gsm8k"``) used instead of files; needs network."""
    hf_config: str = "main"
    """The hub data set's configuration (GSM8K has ``"main"`` and ``"socratic"``)."""
    limit: int | None = None
    """Keep only the first ``limit`` problems (None: all)."""


def default_data_dir() -> Path:
    """The shipped GSM8K folder: ``<repo>/../shared/data/gsm8k``, else ``<cwd>/../shared/...``.

    Raises:
        FileNotFoundError: neither folder exists; the message lists both and names the
            ``path`` config key to set instead.
    """
    candidates = [_REPO_ROOT.parent / "shared" / "data" / "gsm8k",
                  Path.cwd().resolve().parent / "shared" / "data" / "gsm8k"]
    for folder in candidates:
        if folder.is_dir():
            return folder
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"GSM8K data not found (tried {tried}); set dataset.path to a "
                            "GSM8K JSONL file or folder, or dataset.hf_name to a hub name")


def parse_reference(answer_text: str, where: str = "answer") -> str:
    """The reference answer after the last ``####``, commas removed: ``"...#### 1,200"`` → ``"1200"``.

    Args:
        answer_text: GSM8K's ``answer`` field (worked solution ending in ``#### <number>``).
        where: names the culprit in errors, e.g. ``"train.jsonl:17"``.

    Returns:
        a decimal string such as ``"72"``, ``"-3"``, ``"1200"``.

    Raises:
        ValueError: no ``####`` marker, or what follows it is not a number.
    """
    if not isinstance(answer_text, str) or "####" not in answer_text:
        raise ValueError(f"{where}: GSM8K answer has no '#### <number>' line: {answer_text!r:.120}")
    raw = answer_text.rsplit("####", 1)[1].strip()
    number = raw.replace(",", "")
    if not _REFERENCE_RE.fullmatch(number):
        raise ValueError(f"{where}: GSM8K reference after '####' is not a number: {raw!r}")
    return number


def read_gsm8k_jsonl(path: str | Path, limit: int | None = None) -> list[dict]:
    """Problems from one GSM8K JSONL file; blank lines are skipped.

    Returns:
        ``[{"prompt": question, "answer": reference, "id": i}]`` where ``i`` is the 0-based
        index of the problem in the file (stable across runs).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a malformed line, named as ``<file>:<line>`` (1-based): not JSON, not
            an object, ``question``/``answer`` missing or not text, or no ``#### <number>``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path}")
    problems: list[dict] = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if limit is not None and len(problems) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            problems.append(_problem(row, len(problems), where))
    return problems


def load_gsm8k(config: GSM8KConfig | None = None) -> list[dict]:
    """GSM8K problems from the configured source (see ``GSM8KConfig``).

    Returns:
        ``[{"prompt": str, "answer": str, "id": int}]`` in file order.

    Raises:
        ValueError: unknown split, malformed line (file and line named), or bad ``limit``.
        FileNotFoundError: no data at ``config.path`` or at the default locations.
        RuntimeError: ``hf_name`` given and the hub data set cannot be loaded (no network).
    """
    config = config or GSM8KConfig()
    if config.split not in _SPLITS:
        raise ValueError(f"dataset.split must be one of {_SPLITS}, got {config.split!r}")
    if config.limit is not None and config.limit < 0:
        raise ValueError(f"dataset.limit must be >= 0, got {config.limit}")
    if config.hf_name is not None:
        return _load_hub(config)
    path = Path(config.path) if config.path is not None else default_data_dir()
    if path.is_dir():
        path = path / f"{config.split}.jsonl"
    return read_gsm8k_jsonl(path, limit=config.limit)


def _problem(row: object, index: int, where: str) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"{where}: key {key!r} missing or not a string")
    return {"prompt": row["question"], "answer": parse_reference(row["answer"], where), "id": index}


def _load_hub(config: GSM8KConfig) -> list[dict]:
    try:
        import datasets

        rows = datasets.load_dataset(config.hf_name, config.hf_config, split=config.split)
    except Exception as exc:  # noqa: BLE001 - any hub failure gets the same advice
        raise RuntimeError(
            f"could not load GSM8K from the hub as {config.hf_name!r} ({type(exc).__name__}: {exc}); "
            "without network set dataset.path to the shipped JSONL instead") from exc
    problems = []
    for i, row in enumerate(rows):
        if config.limit is not None and i >= config.limit:
            break
        problems.append(_problem(dict(row), i, f"{config.hf_name}[{config.split}][{i}]"))
    return problems


class GSM8KTask:
    """GSM8K as a task: seeded training draws, the fixed test set, and the math reward.

    Args:
        path: a folder holding ``train.jsonl`` and ``test.jsonl``, or one JSONL file used
            as the training split (the test split is then ``test.jsonl`` beside it);
            None or ``""``: the shipped copy (``default_data_dir()``).
        seed: mixed into every training draw.

    Raises:
        FileNotFoundError: ``path`` given but absent, or no shipped copy found.

    The files are read on first use. Training ids are the problem's 0-based index in the
    training file; test ids are ``TEST_ID_OFFSET + index`` (never colliding with them).
    """

    name = "gsm8k"
    max_answer_tokens = 256
    """Greedy-evaluation budget, tokens: GSM8K solutions are worked steps, not one number."""

    def __init__(self, path: str | Path | None = None, seed: int = 0) -> None:
        root = Path(path) if path else default_data_dir()
        if not root.exists():
            raise FileNotFoundError(f"dataset.path={str(path)!r}: no such GSM8K file or folder")
        if root.is_dir():
            self.train_path, self.test_path = root / "train.jsonl", root / "test.jsonl"
        else:
            self.train_path, self.test_path = root, root.parent / "test.jsonl"
        self.seed = seed
        self._splits: dict[str, list[dict]] = {}

    def spec(self) -> dict:
        """The parameters that define the task's data, e.g. for cache keys."""
        return {"name": self.name, "train": str(self.train_path), "test": str(self.test_path), "seed": self.seed}

    def _split(self, split: str) -> list[dict]:
        if split not in self._splits:
            self._splits[split] = read_gsm8k_jsonl(self.train_path if split == "train" else self.test_path)
        return self._splits[split]

    def test_set(self, n: int = 500) -> list[dict]:
        """The first ``n`` test problems in file order (all of them if fewer), ids offset.

        Raises:
            FileNotFoundError: no test file; ValueError: a malformed line.
        """
        return [{**p, "id": TEST_ID_OFFSET + p["id"]} for p in self._split("test")[:n]]

    def train_problems(self, n: int, seed: int) -> list[dict]:
        """``n`` training problems: the training set shuffled by ``(self.seed, seed)``, epoch
        after epoch (each epoch reshuffled) when ``n`` exceeds its size.

        Raises:
            FileNotFoundError: no training file. ValueError: a malformed line, ``n < 0``,
            or an empty training file.
        """
        if n < 0:
            raise ValueError(f"GSM8KTask.train_problems: n must be >= 0, got {n}")
        pool = self._split("train")
        if not pool and n:
            raise ValueError(f"GSM8KTask: training file {self.train_path} holds no problems")
        rng = random.Random(f"gsm8k-train:{self.seed}:{seed}")
        out: list[dict] = []
        while len(out) < n:
            order = list(range(len(pool)))
            rng.shuffle(order)
            out.extend(dict(pool[i]) for i in order[: n - len(out)])
        return out

    @staticmethod
    def reward(output_text: str, answer: str) -> float:
        """``math_reward``: 1.0 if the response's final answer equals ``answer``, else 0.0."""
        return math_reward(output_text, answer)
