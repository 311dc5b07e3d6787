"""GSM8K grade-school math word problems: loading and reference parsing.

Owns: reading GSM8K through the ``datasets`` library from one source string (the
``dataset.path`` config key): a local JSONL/JSON/parquet file, a local folder, or a hub
name (``openai/gsm8k``, read from the local Hugging Face cache when offline); empty = the
copy shipped inside the package (``areal_flow/data/gsm8k/{train,test}.jsonl``, MIT,
OpenAI). Each row ``{"question": ..., "answer": ...}`` becomes a problem dict
``{"prompt": question, "answer": "72", "id": int}``, the reference being the number after
``####`` on the answer's last line. ``GSM8KTask`` is the task object the ``dataset`` op
builds (train draws, held-out test set, reward). Must not: tokenize or apply chat
templates (the prompt is the bare question); scoring is
``areal_flow.rewards.math.math_reward``.

Local files are converted by ``datasets`` once into ``<cache root>/datasets``
(``areal_flow.cache``), not into the user's Hugging Face cache; hub names use the
Hugging Face cache as ``datasets`` does.

Source: Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems"
(arXiv:2110.14168); data MIT-licensed by OpenAI (``areal_flow/data/gsm8k/LICENSE``).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from areal_flow.cache import cache_root
from areal_flow.rewards.math import math_reward
from areal_flow.tasks.held_out import TEST_ID_OFFSET

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "data" / "gsm8k"
_SPLITS = ("train", "test")
_SUFFIXES = (".jsonl", ".json", ".parquet")
_REFERENCE_RE = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class GSM8KConfig:
    """Where GSM8K comes from."""

    split: str = "train"
    """``"train"`` (7473 problems) or ``"test"`` (1319 problems)."""
    path: str | None = None
    """A JSONL/JSON/parquet file (the train split; the test split is ``test.<suffix>``
    beside it), a folder holding ``<split>.<suffix>`` (or files ``datasets`` recognises by
    split name), or a hub name such as ``"openai/gsm8k"``; None or ``""``: the shipped copy."""
    hf_config: str = "main"
    """The hub data set's configuration (GSM8K has ``"main"`` and ``"socratic"``)."""
    limit: int | None = None
    """Keep only the first ``limit`` problems (None: all)."""


def default_data_dir() -> Path:
    """The GSM8K copy shipped inside the package: ``areal_flow/data/gsm8k``.

    Raises:
        FileNotFoundError: the package was installed without its data (a broken build).
    """
    if not (SHIPPED_DIR / "train.jsonl").is_file():
        raise FileNotFoundError(f"the shipped GSM8K copy is missing from {SHIPPED_DIR} (reinstall areal-flow); "
                                "or set dataset.path to a GSM8K file, folder or hub name")
    return SHIPPED_DIR


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
    """Problems from one local GSM8K file (JSONL, JSON or parquet) via ``datasets``.

    Returns:
        ``[{"prompt": question, "answer": reference, "id": i}]`` where ``i`` is the 0-based
        index of the problem in the file (blank lines skipped; stable across runs).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a malformed row, named as ``<file>:<line>`` (1-based) for JSONL: not
            JSON, not an object, ``question``/``answer`` missing or not text, or no
            ``#### <number>``; ``<file>[<row>]`` for other formats.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path}")
    kind = "parquet" if path.suffix == ".parquet" else "json"
    try:
        rows = _datasets().load_dataset(kind, data_files=str(path), split="train",
                                        cache_dir=str(cache_root() / "datasets"))
    except Exception as exc:  # noqa: BLE001 - datasets wraps arrow's errors; find the line ourselves
        if kind == "json":
            _raise_bad_json_line(path)
        raise ValueError(f"{path}: could not read it as {kind} ({type(exc).__name__}: {exc})") from None
    return _problems(rows, limit, lambda i: _jsonl_line(path, i) if kind == "json" else f"{path}[{i}]")


def load_gsm8k(config: GSM8KConfig | None = None) -> list[dict]:
    """GSM8K problems of ``config.split`` from ``config.path`` (see ``GSM8KConfig``).

    Returns:
        ``[{"prompt": str, "answer": str, "id": int}]`` in source order.

    Raises:
        ValueError: unknown split, malformed row (file and line named), or bad ``limit``.
        FileNotFoundError: ``path`` looks like a local path (has a data suffix, or starts
            with ``/``, ``.`` or ``~``) but does not exist.
        RuntimeError: ``path`` taken as a hub name could not be loaded (not in the local
            Hugging Face cache and no network), naming ``dataset.path``.
    """
    config = config or GSM8KConfig()
    if config.split not in _SPLITS:
        raise ValueError(f"dataset.split must be one of {_SPLITS}, got {config.split!r}")
    if config.limit is not None and config.limit < 0:
        raise ValueError(f"dataset.limit must be >= 0, got {config.limit}")
    source = resolve_source(config.path)
    if isinstance(source, str):
        return _load_hub(source, config)
    return read_gsm8k_jsonl(split_file(source, config.split), limit=config.limit)


def resolve_source(path: str | Path | None) -> Path | str:
    """``dataset.path`` -> a local ``Path`` (file or folder) or a hub name ``str``.

    Raises:
        FileNotFoundError: a local-looking path that does not exist, naming ``dataset.path``.
    """
    if not path:
        return default_data_dir()
    text = str(path)
    local = Path(text).expanduser()
    if local.exists():
        return local
    if local.suffix in _SUFFIXES or text.startswith(("/", ".", "~")) or text.count("/") > 1:
        raise FileNotFoundError(f"dataset.path={text!r}: no such GSM8K file or folder")
    return text


def split_file(source: Path, split: str) -> Path:
    """The file of ``split`` in a local source: a folder's ``<split>.<suffix>``; for a file,
    the file itself (train) or ``<split><suffix>`` beside it.

    Raises:
        FileNotFoundError: no such file, naming the folder and the names tried.
    """
    if source.is_file():
        return source if split == "train" else source.with_name(f"{split}{source.suffix}")
    for suffix in _SUFFIXES:
        if (source / f"{split}{suffix}").is_file():
            return source / f"{split}{suffix}"
    names = ", ".join(f"{split}{s}" for s in _SUFFIXES)
    raise FileNotFoundError(f"dataset.path={str(source)!r}: the folder holds none of {names}")


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ModuleNotFoundError("GSM8K is read with the 'datasets' package: pip install datasets") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _problems(rows, limit: int | None, where) -> list[dict]:
    problems = []
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            break
        problems.append(_problem(row, i, where))
    return problems


def _problem(row: object, index: int, where) -> dict:
    """``where(index)`` names the row in errors (computed only on error)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where(index)}: expected a JSON object, got {type(row).__name__}")
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"{where(index)}: key {key!r} missing or not a string")
    try:
        reference = parse_reference(row["answer"])
    except ValueError as exc:
        raise ValueError(f"{where(index)}: {str(exc).split(': ', 1)[1]}") from None
    return {"prompt": row["question"], "answer": reference, "id": index}


def _jsonl_line(path: Path, row_index: int) -> str:
    """``<file>:<line>`` of the ``row_index``-th non-blank line (1-based line)."""
    seen = -1
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            seen += bool(line.strip())
            if seen == row_index:
                return f"{path}:{line_no}"
    return f"{path}[{row_index}]"


def _raise_bad_json_line(path: Path) -> None:
    """Raise ValueError naming the first line of a JSONL file that is not a JSON object."""
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
    raise ValueError(f"{path}: datasets could not read it as JSON lines (mixed types across rows?)")


def _load_hub(name: str, config: GSM8KConfig) -> list[dict]:
    datasets = _datasets()
    try:
        rows = datasets.load_dataset(name, config.hf_config, split=config.split)
    except Exception as exc:  # noqa: BLE001 - any hub failure gets the same advice
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise RuntimeError(
            f"dataset.path={name!r}: not a local file or folder, and loading it as a hub data set failed "
            f"({type(exc).__name__}: {first}); offline, only names in the local Hugging Face cache work") from None
    return _problems(rows, config.limit, lambda i: f"{name}[{config.split}][{i}]")


class GSM8KTask:
    """GSM8K as a task: seeded training draws, the fixed test set, and the math reward.

    Args:
        path: ``dataset.path`` (see ``GSM8KConfig.path``): a local file (the training split;
            the test split is ``test.<suffix>`` beside it), a folder, or a hub name;
            None or ``""``: the shipped copy (``default_data_dir()``).
        seed: mixed into every training draw.

    Raises:
        FileNotFoundError: a local-looking ``path`` that does not exist.

    The data are read on first use. Training ids are the problem's 0-based index in the
    training split; test ids are ``TEST_ID_OFFSET + index`` (never colliding with them).
    """

    name = "gsm8k"
    max_answer_tokens = 256
    """Greedy-evaluation budget, tokens: GSM8K solutions are worked steps, not one number."""

    def __init__(self, path: str | Path | None = None, seed: int = 0) -> None:
        self.source = resolve_source(path)
        self.seed = seed
        self._splits: dict[str, list[dict]] = {}

    def spec(self) -> dict:
        """The parameters that define the task's data, e.g. for cache keys."""
        return {"name": self.name, "source": str(self.source), "seed": self.seed}

    def _split(self, split: str) -> list[dict]:
        if split not in self._splits:
            if isinstance(self.source, str):
                self._splits[split] = _load_hub(self.source, GSM8KConfig(split=split, path=self.source))
            else:
                self._splits[split] = read_gsm8k_jsonl(split_file(self.source, split))
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
            raise ValueError(f"GSM8KTask: the training split of {self.source} holds no problems")
        rng = random.Random(f"gsm8k-train:{self.seed}:{seed}")
        out: list[dict] = []
        while len(out) < n:
            order = list(range(len(pool)))
            rng.shuffle(order)
            out.extend(dict(pool[i]) for i in order[: n - len(out)])
        return out

    @staticmethod
    def correct(output_text: str, answer: str) -> bool:
        """Whether the response's final answer is right (:meth:`reward` 1.0): the run's accuracy."""
        return math_reward(output_text, answer) == 1.0

    @staticmethod
    def reward(output_text: str, answer: str) -> float:
        """``math_reward``: 1.0 if the response's final answer equals ``answer``, else 0.0."""
        return math_reward(output_text, answer)
