"""The rollout worker: runs a graph's ``dataset -> generate -> reward`` nodes in one process.

Owns the generation side of the asynchronous loop. It admits prompt groups under the
bounded-staleness rule (:class:`runtime.staleness.AdmissionController`), decodes them with
continuous batching, scores finished groups with the reward node
(:class:`areal_flow.ops.reward.RewardRunner`), and sends each group, with its admission
index, on the experience channel. A group the reward node's filter drops (DAPO dynamic
sampling) is replaced by a new prompt under the *same* admission index, so the staleness
proof of ``runtime.staleness`` holds unchanged: the replacement's tokens come from a
version no older than the slot's admission version. Between decode steps it
polls the weight channel; a new version pauses in-flight sequences, loads the weights and
resumes them (their KV cache recomputed), so nothing is discarded. It must not decide
placement or train.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from areal_flow.ops.dataset import build_task
from areal_flow.ops.generate import encode_prompt
from areal_flow.ops.reward import RewardRunner
from areal_flow.types import Trajectory
from runtime.channels import ExperienceSender
from runtime.engines.generation import GenerationEngine, GenerationRequest, GenerationResult, SamplingParams
from runtime.model_source import load_pretrained
from runtime.staleness import AdmissionController
from runtime.weights import WeightSubscriber

logger = logging.getLogger(__name__)


@dataclass
class RolloutSpec:
    """What the rollout worker needs, extracted from the graph and config by the launcher.

    Attributes:
        model_folder: initial policy (version 0) in ``transformers`` format.
        dataset_attrs / generate_attrs / reward_fn: the graph nodes' attributes.
        reward_attrs: the reward node's other attributes (``keep``, ``max_attempts``,
            ``overlong``); empty = plain scoring.
        n_groups: prompt groups to generate in total (``steps * batch_groups``).
        batch_groups: B, prompt groups per train step.
        max_staleness: k of the data edge into ``train_step``.
        max_batch_size: engine slots (sequences decoded together).
        seed: data and sampling seed.
        experience_address / weight_address: the two channels.
        threads: torch intra-op threads of this process.
    """

    model_folder: str
    dataset_attrs: dict
    generate_attrs: dict
    reward_fn: object
    n_groups: int
    batch_groups: int
    max_staleness: int
    max_batch_size: int
    seed: int
    experience_address: str
    weight_address: str
    threads: int = 1
    reward_attrs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutResume:
    """Where a restarted rollout worker picks up, as the trainer reports it.

    Attributes:
        held: admission indices the trainer already received or trained; they are admitted
            and completed at once, never regenerated, so every other index is generated
            again under its own number (no group lost or trained twice).
        version: the trainer's current policy version; the worker waits for it on the
            weight channel before admitting anything (so the staleness proof of
            ``runtime.staleness`` holds as for a fresh worker).
        timeout_s: seconds to wait for that version.
    """

    held: frozenset[int]
    version: int
    timeout_s: float = 600.0


class _Group:
    def __init__(self, index: int, problem: dict, n: int):
        self.index, self.problem, self.n = index, problem, n
        self.attempt = 1  # prompts tried for this admission index (dynamic sampling)
        self.results: list[GenerationResult] = []


def _to_trajectory(result: GenerationResult, group: _Group, tokenizer) -> Trajectory:
    return Trajectory(
        sample_id=f"{group.index}:{result.meta['sample']}",
        group_id=group.index,
        prompt_ids=list(result.prompt_ids),
        output_ids=list(result.output_ids),
        behavior_logprobs=list(result.behavior_logprobs),
        versions=list(result.versions),
        finish_reason=result.finish_reason,
        prompt_text=group.problem["prompt"],
        output_text=result.output_text,
        meta={"answer": group.problem["answer"], "problem_id": group.problem["id"]},
    )


def run_rollout_worker(spec: RolloutSpec, resume: RolloutResume | None = None) -> dict:
    """Generate ``spec.n_groups`` groups, honouring the staleness bound; returns counters.

    ``resume`` restarts after a worker died: only the indices the trainer does not hold are
    generated (``held_groups`` in the counters counts the others).

    Raises:
        TimeoutError: resuming, the trainer's policy version did not arrive in time.
        runtime.weights.WeightChecksumError: a corrupted weight bucket (the engine keeps
            its previous weights; the error propagates to the launcher).
        areal_flow.ops.reward.DynamicSamplingError: a slot drew ``max_attempts``
            all-equal groups in a row (the reward node's ``keep="informative"``).
    """
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    model, tokenizer = load_pretrained(spec.model_folder)
    engine = GenerationEngine(model, tokenizer, max_batch_size=spec.max_batch_size, seed=spec.seed)
    task = build_task(spec.dataset_attrs, spec.seed)
    problems = task.train_problems(spec.n_groups, seed=spec.seed + 1)
    reward = RewardRunner({**spec.reward_attrs, "fn": spec.reward_fn})
    # Replacement prompts for dropped groups: a separate seeded stream, at most
    # max_attempts - 1 per slot (the bound makes RewardRunner raise before it runs out).
    spares = iter(task.train_problems(spec.n_groups * (reward.max_attempts - 1), seed=spec.seed + 2)
                  if reward.keep != "all" else [])
    dropped = 0
    g = spec.generate_attrs
    params = SamplingParams(temperature=g["temperature"], top_p=g["top_p"], max_new_tokens=g["max_new_tokens"])

    def submit(group: _Group) -> None:
        prompt_ids = encode_prompt(tokenizer, group.problem["prompt"], g.get("chat_template"))
        tag = "" if group.attempt == 1 else f"/{group.attempt}"
        for j in range(group.n):
            engine.submit(GenerationRequest(f"{group.index}:{j}{tag}", prompt_ids, params,
                                            {"group": group.index, "sample": j}))
    admission = AdmissionController(spec.max_staleness, spec.batch_groups)
    # A trainer may bind its end after the last group is sent (a multi-process trainer starts
    # slowly): close() waits up to 120 s to deliver; a dead trainer's launcher ends us first.
    sender = ExperienceSender(spec.experience_address, linger_s=120.0)
    weights = WeightSubscriber(spec.weight_address)
    groups: dict[int, _Group] = {}
    weight_updates = held = 0
    try:
        if resume is not None:
            update = weights.wait(min_version=resume.version, timeout_s=resume.timeout_s)
            if update is None:
                raise TimeoutError(f"resuming rollout worker: policy version {resume.version} did not arrive "
                                   f"on {spec.weight_address} within {resume.timeout_s} s")
            engine.update_weights(update[1], update[0])
            weight_updates += 1
        while admission.accepted < spec.n_groups:
            update = weights.poll()
            if update is not None:
                engine.update_weights(update[1], update[0])
                weight_updates += 1
            while len(groups) + admission.accepted < spec.n_groups and admission.can_admit(engine.version):
                index = admission.admit(engine.version)
                if resume is not None and index in resume.held:
                    admission.complete(index)  # the trainer has this group already
                    held += 1
                    continue
                submit(groups.setdefault(index, _Group(index, problems[index], g["n_samples"])))
            if not engine.has_work():
                # Admission is closed until the trainer publishes a newer version.
                update = weights.wait(min_version=engine.version + 1, timeout_s=1.0)
                if update is not None:
                    engine.update_weights(update[1], update[0])
                    weight_updates += 1
                continue
            for result in engine.step():
                group = groups[result.meta["group"]]
                group.results.append(result)
                if len(group.results) == group.n:
                    trajectories = [
                        _to_trajectory(r, group, tokenizer) for r in sorted(group.results, key=lambda r: r.meta["sample"])
                    ]
                    if not reward(trajectories, group.index, group.attempt):
                        dropped += 1  # all-equal rewards: same slot, next prompt
                        group.problem, group.attempt, group.results = next(spares), group.attempt + 1, []
                        submit(group)
                        continue
                    sender.send(group.index, trajectories)
                    admission.complete(group.index)
                    del groups[group.index]
    finally:
        sender.close()
        weights.close()
    return {"groups": admission.accepted, "weight_updates": weight_updates, "final_version": engine.version,
            "dropped_groups": dropped, "held_groups": held}
