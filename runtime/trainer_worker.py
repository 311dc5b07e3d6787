"""The trainer worker: runs a graph's ``advantage -> train_step`` nodes in one process.

Owns the training side of the asynchronous loop. Step ``s`` takes exactly the groups with
admission indices ``[s*B, (s+1)*B)`` from the experience channel
(:class:`runtime.staleness.OrderedExperienceBuffer` checks each sample's staleness
``s - start_version <= k``), computes advantages with the advantage node's estimator, runs
one optimizer step of the ``train_step`` node's algorithm, and publishes the new policy
version on the weight channel. It writes every trained trajectory (with the step that
consumed it and its staleness) as JSONL and sends per-step metrics to the launcher.
It must not decide placement or generate.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from areal_flow.algorithms.advantages import compute_advantages
from areal_flow.algorithms.registry import build_algorithm
from areal_flow.types import Trajectory
from runtime.batching import collate
from runtime.channels import ExperienceReceiver
from runtime.model_source import load_pretrained
from runtime.staleness import OrderedExperienceBuffer
from runtime.weights import WeightPublisher


@dataclass
class TrainerSpec:
    """What the trainer worker needs, extracted from the graph and config by the launcher.

    Attributes:
        model_folder: initial policy (version 0) in ``transformers`` format.
        algorithm: registered algorithm name of the ``train_step`` node.
        estimator / estimator_kwargs: the ``advantage`` node's estimator and knobs.
        loss_overrides: ``LossConfig`` fields changed from the algorithm's defaults.
        steps: optimizer steps; batch_groups: B; max_staleness: k.
        lr / weight_decay / max_grad_norm / micro_batch_size: optimizer settings.
        temperature: the sampling temperature (log-probs are recomputed at it).
        experience_address / weight_address: the two channels.
        out_dir: run folder (trajectories/, model/).
        threads: torch intra-op threads of this process.
    """

    model_folder: str
    algorithm: str
    estimator: str
    estimator_kwargs: dict
    loss_overrides: dict
    steps: int
    batch_groups: int
    max_staleness: int
    lr: float
    weight_decay: float
    max_grad_norm: float
    micro_batch_size: int
    temperature: float
    seed: int
    experience_address: str
    weight_address: str
    out_dir: str
    threads: int = 1
    recv_timeout_s: float = 600.0


def _trajectory_record(t: Trajectory, step: int) -> dict:
    record = asdict(t)
    record.update(step=step, staleness=t.staleness(step))
    return record


def run_trainer_worker(spec: TrainerSpec, metrics_queue) -> dict:
    """Train ``spec.steps`` steps; puts one metrics dict per step on ``metrics_queue``.

    Raises:
        TimeoutError: no experience arrived for ``recv_timeout_s`` seconds (generator dead).
        runtime.staleness.StalenessViolation: a sample beyond the bound (a broken invariant).
    """
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    model, tokenizer = load_pretrained(spec.model_folder)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    algorithm = build_algorithm(
        spec.algorithm, model, optimizer, loss_overrides=dict(spec.loss_overrides),
        micro_batch_size=spec.micro_batch_size, max_grad_norm=spec.max_grad_norm, temperature=spec.temperature,
    )
    receiver = ExperienceReceiver(spec.experience_address)
    publisher = WeightPublisher(spec.weight_address)
    buffer = OrderedExperienceBuffer(spec.batch_groups, spec.max_staleness)
    out = Path(spec.out_dir)
    (out / "trajectories").mkdir(parents=True, exist_ok=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        with (out / "trajectories" / "trajectories.jsonl").open("w") as log:
            for step in range(spec.steps):
                waited = time.perf_counter()
                while not buffer.ready(step):
                    item = receiver.recv(timeout_s=spec.recv_timeout_s)
                    if item is None:
                        raise TimeoutError(f"trainer step {step}: no experience for {spec.recv_timeout_s} s")
                    buffer.put(*item)
                wait_s = time.perf_counter() - waited
                started = time.perf_counter()
                trajectories = [t for group in buffer.take_batch(step) for t in group]
                batch = collate(trajectories, pad_id)
                batch["advantages"] = compute_advantages(
                    spec.estimator, rewards=batch["rewards"], group_ids=batch["group_ids"],
                    loss_mask=batch["loss_mask"], **spec.estimator_kwargs,
                ).advantages
                stats = algorithm.update_parameters(batch)
                publisher.publish({k: v.detach() for k, v in model.state_dict().items()}, step + 1)
                train_s = time.perf_counter() - started
                for t in trajectories:
                    log.write(json.dumps(_trajectory_record(t, step)) + "\n")
                log.flush()
                staleness = [t.staleness(step) for t in trajectories]
                n_tokens = int(batch["attention_mask"].sum())
                metrics_queue.put({
                    "step": step, "version": step + 1, **{f"train/{k}": float(v) for k, v in stats.items()},
                    "reward": float(batch["rewards"].mean()),
                    "accuracy": float((batch["rewards"] >= 1.0).float().mean()),
                    "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
                    "staleness": staleness, "samples": len(trajectories),
                    "response_len": float(batch["loss_mask"].sum(1).mean()),
                    "tokens_per_s": n_tokens / max(train_s, 1e-9), "train_s": train_s, "wait_s": wait_s,
                })
        model.save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")
    finally:
        receiver.close()
        publisher.close()
    return {"steps": spec.steps, "consumed": len(buffer.consumed_ids)}
