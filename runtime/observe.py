"""What a trainer reports besides its losses: the step's metrics and the memory profile.

Owns the metrics dict a stage worker sends to the driver each step (``runtime.metrics``
turns it into TensorBoard/W&B scalars) and ``debug.memory_profiler``'s records. It must not
train or schedule.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from areal_flow.types import REPLAYED, Trajectory


def memory_profile(step: int, path: Path, executors: list, cuda: bool = False) -> None:
    """Append this step's memory to ``path`` (JSONL): process RSS and, per train_step
    executor, the bytes of its model's parameters, gradients and optimizer state; CUDA
    allocator figures when the plan runs on CUDA (bytes)."""
    import psutil

    record = {"step": step, "rss_bytes": psutil.Process().memory_info().rss}
    for ex in executors:
        params = list(ex.model.parameters())
        tensors = params + [p.grad for p in params if p.grad is not None]
        optimizer = getattr(ex, "optimizer", None) or ex.algorithm.optimizer
        tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        record[f"{ex.node.name}/tensor_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    if cuda and torch.cuda.is_available():
        record.update(cuda_allocated_bytes=torch.cuda.memory_allocated(),
                      cuda_reserved_bytes=torch.cuda.memory_reserved())
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")


def step_metrics(step: int, stats: dict, batch: dict, trajectories: list[Trajectory], train_s: float,
                 wait_s: float) -> dict:
    """The launcher's metrics of one step: ``train/*`` from the train_steps, reward,
    ``accuracy`` (the fraction of the step's samples the task judged right,
    ``Trajectory.correct``, over those it judged; absent when it judged none), staleness
    (versions), response length (tokens), throughput (tokens/s), times (seconds);
    ``reward/failures``: samples of the step's groups whose reward failed (left out of
    training, ``runtime.groups.drop_failed_samples``; a group with none left was resampled
    and is counted only in the worker's ``<reward node>/failures``); ``samples`` and staleness
    count the step's fresh samples, ``samples_replayed`` the rows a replay node drew again
    (``areal_flow.types.REPLAYED``; their staleness is the node's ``replay/staleness_max``)."""
    fresh = [t for t in trajectories if REPLAYED not in t.meta]
    staleness = [t.staleness(step) for t in fresh]
    n_tokens = int(batch["attention_mask"].sum())
    judged = [t.correct for t in trajectories if t.correct is not None]
    return {**_episode_metrics(trajectories), **({"accuracy": sum(judged) / len(judged)} if judged else {}),
        "step": step, "version": step + 1, **{k if "/" in k else f"train/{k}": float(v) for k, v in stats.items()},
        "reward": float(batch["rewards"].mean()),
        "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
        "staleness": staleness, "samples": len(fresh), "samples_replayed": len(trajectories) - len(fresh),
        "response_len": float(batch["loss_mask"].sum(1).mean()),
        "tokens_per_s": n_tokens / max(train_s, 1e-9), "train_s": train_s, "wait_s": wait_s,
        "reward/failures": float(sum({t.group_id: t.meta.get("reward_failures", 0) for t in trajectories}.values())),
    }


def _episode_metrics(trajectories: list[Trajectory]) -> dict:
    """Multi-turn episodes (``ops.rollout``): ``episode/return`` (the discounted return),
    ``episode/turns``, ``episode/tool_call_error_rate`` (malformed tool calls per turn),
    ``env/failures`` (failed episodes in the step's groups, left out of training) and the
    per-episode mean of every numeric ``info`` key the env reported (``env/<key>``, summed
    over an episode's steps). Empty for single-turn rollouts."""
    episodes = [t for t in trajectories if t.turn_rewards is not None]
    if not episodes:
        return {}
    n = len(episodes)
    turns = sum(t.meta.get("turns", len(t.turn_rewards)) for t in episodes)
    groups = {t.group_id: t.meta.get("group_failed", 0) for t in episodes}
    out = {"episode/return": sum(float(t.reward) for t in episodes) / n, "episode/turns": turns / n,
           "episode/tool_call_error_rate": sum(t.meta.get("tool_errors", 0) for t in episodes) / max(turns, 1),
           "env/failures": float(sum(groups.values()))}
    for key in sorted({k for t in episodes for k in t.meta.get("env", {})}):
        out[f"env/{key}"] = sum(t.meta.get("env", {}).get(key, 0.0) for t in episodes) / n
    return out
