"""The plan-for-a-GPU-on-a-CPU-machine warning."""

from __future__ import annotations

import sys
import types

from compiler.device_check import cuda_device_present, device_mismatch_warning


def test_warning_text_only_without_cuda():
    text = device_mismatch_warning("H100", cuda_present=False)
    assert text.startswith("the plan is for H100 but this run is on CPU") and "cluster.gpu=cpu" in text
    assert device_mismatch_warning("H100", cuda_present=True) is None
    assert device_mismatch_warning("cpu", cuda_present=False) is None


def test_imported_torch_is_asked_first(monkeypatch):
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert cuda_device_present() is True
    fake.cuda.is_available = lambda: False
    assert device_mismatch_warning("A100").startswith("the plan is for A100")


def test_without_torch_the_driver_decides(monkeypatch, tmp_path):
    import compiler.device_check as check

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(check, "NVIDIA_PROC", tmp_path / "gpus")
    monkeypatch.setattr(check.shutil, "which", lambda name: None)  # no nvidia-smi
    assert cuda_device_present() is False
    (tmp_path / "gpus" / "0000:01:00.0").mkdir(parents=True)  # the driver lists one GPU
    assert cuda_device_present() is True
