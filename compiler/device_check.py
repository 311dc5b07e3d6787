"""Does this machine have the accelerator a plan was made for?

Owns :func:`device_mismatch_warning`, the text the runtime prints when ``cluster.gpu``
names a GPU but the run finds none. Must not import torch (the check runs before the
workers start; torch is consulted only when some module already imported it) nor stop the
run: a CPU run of a GPU plan is allowed (e.g. a dry run), only worth a warning.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")
"""One entry per GPU the NVIDIA kernel driver found."""


def cuda_device_present() -> bool:
    """True when a CUDA device is visible: ``torch.cuda.is_available()`` if torch is already
    imported, else the NVIDIA driver's ``/proc/driver/nvidia/gpus`` entries or an
    ``nvidia-smi -L`` listing at least one GPU (5 s limit)."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "cuda"):
        return bool(torch.cuda.is_available())
    if NVIDIA_PROC.is_dir() and any(NVIDIA_PROC.iterdir()):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "GPU" in listing


def device_mismatch_warning(gpu: str, cuda_present: bool | None = None) -> str | None:
    """The warning for a plan made for ``gpu`` (``cluster.gpu``) on a machine without CUDA;
    None when ``gpu`` is ``cpu`` or a CUDA device is present.

    Args:
        gpu: the plan's device preset name (``H100``, ``A100``, ``cpu``, ...).
        cuda_present: override the detection (``cuda_device_present()`` when None).
    """
    if gpu.lower() == "cpu":
        return None
    if cuda_present is None:
        cuda_present = cuda_device_present()
    if cuda_present:
        return None
    return (f"the plan is for {gpu} but this run is on CPU (no CUDA device found): memory and time estimates "
            f"do not apply; set cluster.gpu=cpu for a CPU plan")
