"""The trainer worker: runs a graph's ``advantage -> train_step`` nodes in one process.

Owns the training side of the asynchronous loop. Step ``s`` takes exactly the groups with
admission indices ``[s*B, (s+1)*B)`` from the experience channel
(:class:`runtime.staleness.OrderedExperienceBuffer` checks each sample's staleness
``s - start_version <= k``), computes advantages with the advantage node's estimator over
the whole step batch (with the critic's values for GAE, or the reference policy's KL
folded into the reward for REINFORCE++), runs one optimizer step of the ``train_step``
node's algorithm (which also steps the critic, PPO), and publishes the new policy
version on the weight channel. It writes every trained trajectory (with the step that
consumed it and its staleness) as JSONL and sends per-step metrics to the launcher.
It must not decide placement or generate.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from areal_flow.algorithms.advantages import compute_advantages
from areal_flow.algorithms.base import BaseAlgorithm
from areal_flow.algorithms.kl import kl_penalty
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
        critic: train a value model (``areal_flow.models.critic``) built from
            ``model_folder`` with the policy; it is saved to ``out_dir/critic``.
        ref: load a frozen reference policy (the initial ``model_folder``): its KL is
            folded into the reward when the loss says ``kl_in_reward``, else it serves
            the loss's KL term.
        checkpoint_every: save the policy to ``out_dir/checkpoints/version_<v>`` every this
            many steps (0: only the final ``out_dir/model``).
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
    critic: bool = False
    ref: bool = False
    checkpoint_every: int = 0


def _trajectory_record(t: Trajectory, step: int) -> dict:
    record = asdict(t)
    record.update(step=step, staleness=t.staleness(step))
    return record


def step_metrics(step: int, stats: dict, batch: dict, trajectories: list[Trajectory], train_s: float,
                 wait_s: float) -> dict:
    """The launcher's metrics of one step: ``train/*`` from the algorithm, reward, accuracy,
    staleness (versions), response length (tokens), throughput (tokens/s), times (seconds)."""
    staleness = [t.staleness(step) for t in trajectories]
    n_tokens = int(batch["attention_mask"].sum())
    return {
        "step": step, "version": step + 1, **{f"train/{k}": float(v) for k, v in stats.items()},
        "reward": float(batch["rewards"].mean()),
        "accuracy": float((batch["rewards"] >= 1.0).float().mean()),
        "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
        "staleness": staleness, "samples": len(trajectories),
        "response_len": float(batch["loss_mask"].sum(1).mean()),
        "tokens_per_s": n_tokens / max(train_s, 1e-9), "train_s": train_s, "wait_s": wait_s,
    }


def _extra_models(spec: TrainerSpec) -> dict:
    """``critic`` + ``critic_optimizer`` and ``ref_model`` for ``build_algorithm``."""
    extra: dict = {}
    if spec.critic:
        from areal_flow.models.critic import ValueModel

        critic = ValueModel.from_policy(spec.model_folder, seed=spec.seed).train()
        extra["critic"] = critic
        extra["critic_optimizer"] = torch.optim.AdamW(critic.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    if spec.ref:
        ref, _ = load_pretrained(spec.model_folder)
        extra["ref_model"] = ref.requires_grad_(False)
    return extra


def _add_advantages(batch: dict, algorithm: BaseAlgorithm, spec: TrainerSpec) -> float | None:
    """Put ``advantages [B, T]`` (and ``values``/``returns [B, T]`` with a critic) into
    ``batch``, computed over the whole step batch. With ``kl_in_reward`` and a reference
    model, the per-token KL (``loss_cfg.kl_estimator`` of behavior vs reference log-probs,
    nats) enters the token reward with weight ``kl_coef`` (REINFORCE++, Hu 2025 §3).

    Returns:
        the mean folded KL per response token (nats), or None when none was folded.

    Raises:
        ValueError: a critic with an estimator that gives no returns (value targets).
    """
    cfg = algorithm.loss_cfg
    ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    inputs = dict(rewards=batch["rewards"], group_ids=batch["group_ids"], loss_mask=mask)
    if algorithm.critic is not None:
        batch["values"] = inputs["values"] = algorithm.compute_values(ids, attn)
    kl_mean = None
    if algorithm.ref_model is not None and cfg.kl_in_reward:
        kl = kl_penalty(batch["behavior_logprobs"], algorithm.ref_logprobs(ids, attn), cfg.kl_estimator,
                        loss_mask=mask, log_ratio_clamp=cfg.log_ratio_clamp)
        inputs.update(kl=kl, kl_coef=cfg.kl_coef)
        kl_mean = float(kl.sum() / mask.sum().clamp(min=1))
    out = compute_advantages(spec.estimator, **inputs, **spec.estimator_kwargs)
    batch["advantages"] = out.advantages
    if algorithm.critic is not None:
        if out.returns is None:
            raise ValueError(f"estimator {spec.estimator!r} gives no returns to train the critic on (use 'gae')")
        batch["returns"] = out.returns
    return kl_mean


def receive_step(receiver: ExperienceReceiver, buffer: OrderedExperienceBuffer, step: int, timeout_s: float,
                 held: set[int] | None = None, on_idle=None) -> float:
    """Fill ``buffer`` until the groups of ``step`` are all there; returns the seconds waited.

    Every received admission index is added to ``held`` (when given). ``on_idle`` (optional) runs
    between polls of 0.2 s, e.g. to answer restarted rollout workers.

    Raises:
        TimeoutError: no experience arrived for ``timeout_s`` seconds (generator dead).
    """
    waited = time.perf_counter()
    while not buffer.ready(step):
        if on_idle is not None:
            on_idle()
        item = receiver.recv(timeout_s=timeout_s if on_idle is None else 0.2)
        if item is None:
            if time.perf_counter() - waited < timeout_s:
                continue
            raise TimeoutError(f"trainer step {step}: no experience for {timeout_s} s")
        if held is not None:
            held.add(item[0])
        buffer.put(*item)
    return time.perf_counter() - waited


def _serve_resync(requests: queue.Queue, receiver: ExperienceReceiver, buffer: OrderedExperienceBuffer,
                  held: set[int], model: torch.nn.Module, version: int, publisher: WeightPublisher) -> WeightPublisher:
    """Answer restarted rollout workers; returns the weight publisher to use from now on.

    A request is ``(weight_address, reply_queue)``. The experience channel is drained first
    (the dead worker's last groups), then the reply ``{"held": sorted admission indices
    received or trained, "version": the current policy version}`` is put on the queue and
    that version is published to the new worker's ``weight_address``.
    """
    while True:
        try:
            address, reply = requests.get_nowait()
        except queue.Empty:
            return publisher
        while (item := receiver.recv(timeout_s=0)) is not None:
            held.add(item[0])
            buffer.put(*item)
        old, publisher = publisher, WeightPublisher(address)
        publisher.publish({k: v.detach() for k, v in model.state_dict().items()}, version)
        threading.Thread(target=old.close, daemon=True).start()  # its peer is dead: lingering here would stall
        reply.put({"held": sorted(held), "version": version})


def run_trainer_worker(spec: TrainerSpec, metrics_queue, resync: queue.Queue | None = None) -> dict:
    """Train ``spec.steps`` steps; puts one metrics dict per step on ``metrics_queue``.

    ``resync`` (optional) carries requests from restarted rollout workers, served while the
    trainer waits for experience (see :func:`_serve_resync`). A step that saves a checkpoint
    adds its folder as ``"checkpoint"`` to its metrics.

    Raises:
        TimeoutError: no experience arrived for ``recv_timeout_s`` seconds (generator dead).
        runtime.staleness.StalenessViolation: a sample beyond the bound (a broken invariant).
    """
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    model, tokenizer = load_pretrained(spec.model_folder)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    extra_models = _extra_models(spec)
    algorithm = build_algorithm(
        spec.algorithm, model, optimizer, loss_overrides=dict(spec.loss_overrides),
        micro_batch_size=spec.micro_batch_size, max_grad_norm=spec.max_grad_norm, temperature=spec.temperature,
        **extra_models,
    )
    if algorithm.loss_cfg.kl_in_reward and algorithm.loss_cfg.kl_coef > 0 and algorithm.ref_model is None:
        raise ValueError(f"algorithm {spec.algorithm!r} folds train.loss.kl_coef={algorithm.loss_cfg.kl_coef} into "
                         "the reward: the advantage node needs ref=Model(..., trainable=False)")
    receiver = ExperienceReceiver(spec.experience_address)
    publisher = WeightPublisher(spec.weight_address)
    buffer = OrderedExperienceBuffer(spec.batch_groups, spec.max_staleness)
    held: set[int] = set()  # admission indices received so far
    out = Path(spec.out_dir)
    (out / "trajectories").mkdir(parents=True, exist_ok=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def serve_resync() -> None:
        nonlocal publisher
        publisher = _serve_resync(resync, receiver, buffer, held, model, step, publisher)

    try:
        with (out / "trajectories" / "trajectories.jsonl").open("w") as log:
            for step in range(spec.steps):
                wait_s = receive_step(receiver, buffer, step, spec.recv_timeout_s, held,
                                      on_idle=serve_resync if resync is not None else None)
                started = time.perf_counter()
                trajectories = [t for group in buffer.take_batch(step) for t in group]
                batch = collate(trajectories, pad_id)
                kl_reward = _add_advantages(batch, algorithm, spec)
                stats = algorithm.update_parameters(batch)
                if kl_reward is not None:
                    stats["kl_ref_in_reward"] = kl_reward
                if step + 1 < spec.steps:  # the generator has everything it needs after the last step
                    publisher.publish({k: v.detach() for k, v in model.state_dict().items()}, step + 1)
                train_s = time.perf_counter() - started
                for t in trajectories:
                    log.write(json.dumps(_trajectory_record(t, step)) + "\n")
                log.flush()
                checkpoint = {}
                if spec.checkpoint_every and (step + 1) % spec.checkpoint_every == 0:
                    checkpoint["checkpoint"] = str(out / "checkpoints" / f"version_{step + 1}")
                    model.save_pretrained(checkpoint["checkpoint"])
                    tokenizer.save_pretrained(checkpoint["checkpoint"])
                metrics_queue.put(step_metrics(step, stats, batch, trajectories, train_s, wait_s) | checkpoint)
        model.save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")
        if algorithm.critic is not None:
            algorithm.critic.save(out / "critic")
    finally:
        receiver.close()
        publisher.close()
    return {"steps": spec.steps, "consumed": len(buffer.consumed_ids)}
