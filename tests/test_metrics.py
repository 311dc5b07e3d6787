"""RunLogger: the optional step keys reach TensorBoard under their tags; W&B offline."""

from __future__ import annotations

import pytest

from areal_flow.config import LoggingConfig
from runtime.metrics import RunLogger


def _step(step: int, **extra) -> dict:
    return {"step": step, "samples": 4, "staleness": [0, 1, 1, 2], "reward": 0.5, "accuracy": 0.25,
            "staleness_mean": 1.0, **extra}


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_optional_keys_logged_only_where_present(tmp_path):
    logger = RunLogger(tmp_path, total_steps=3, show_progress=False)
    logger.log_step(_step(1, lr=1e-4, **{"weights/sync_s": 0.5, "weights/bytes": 2048}))
    logger.log_step(_step(2, **{"reward/failures": 3}))
    logger.log_scalar("eval/accuracy", 0.75, 2)  # a mid-run evaluation at an arbitrary step
    logger.log_step(_step(3, **{"eval/accuracy": 0.8, "train/lr": 5e-5}))
    logger.close()
    tags = _scalars(tmp_path)
    assert tags["train/lr"] == [(1, pytest.approx(1e-4)), (3, pytest.approx(5e-5))]
    assert tags["weights/sync_s"] == [(1, 0.5)] and tags["weights/bytes"] == [(1, 2048.0)]
    assert tags["reward/failures"] == [(2, 3.0)]
    assert tags["eval/accuracy"] == [(2, 0.75), (3, pytest.approx(0.8))]
    assert tags["rl/reward"] == [(1, 0.5), (2, 0.5), (3, 0.5)] and "rl/lr" not in tags
    assert logger.samples == 12 and logger.staleness == {0: 3, 1: 6, 2: 3}


def test_wandb_offline_needs_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional: pip install 'areal-flow[wandb]'")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_API_KEY", "")
    logger = RunLogger(tmp_path, total_steps=1, show_progress=False,
                       wandb=LoggingConfig(wandb=True, wandb_mode="offline"), run_name="t")
    logger.log_step(_step(1, lr=1e-3))
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))  # the run's records, kept for `wandb sync`


def test_wandb_missing_is_one_line(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    cfg = LoggingConfig()
    cfg.wandb = True  # set after validation: the logger's own check
    with pytest.raises(ModuleNotFoundError, match=r"^logging.wandb=true needs the wandb package: pip install"):
        RunLogger(tmp_path, total_steps=1, show_progress=False, wandb=cfg)
