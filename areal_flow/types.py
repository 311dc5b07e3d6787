"""The values that travel on the experience channel: trajectories and their groups.

Owns the plain data records exchanged between graph nodes; no tensors live here so a
record pickles small and crosses processes cheaply. Tensors are built by the trainer's
collate step (``runtime.engines.batching``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trajectory:
    """One sampled response to one prompt.

    Attributes:
        sample_id: unique id ``"{group_id}:{index}"``; every sample is trained exactly once.
        group_id: id of the prompt group (the ``n_samples`` responses of one prompt).
        prompt_ids: prompt token ids, ``[prompt_len]``.
        output_ids: generated token ids, ``[response_len]`` (EOS included when it stopped).
        behavior_logprobs: per generated token, log-prob under the sampling (behavior)
            distribution, ``[response_len]``, natural log.
        versions: per generated token, the policy version that produced it,
            ``[response_len]``; differs within one trajectory when generation was
            interrupted by a weight update.
        finish_reason: ``"stop"`` (EOS) or ``"length"`` (hit ``max_new_tokens``).
        prompt_text / output_text: decoded text.
        reward: scalar reward, filled by the ``reward`` node.
        meta: task data (e.g. the reference answer), never used by the trainer.
    """

    sample_id: str
    group_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    behavior_logprobs: list[float]
    versions: list[int]
    finish_reason: str
    prompt_text: str = ""
    output_text: str = ""
    reward: float | None = None
    meta: dict = field(default_factory=dict)

    @property
    def start_version(self) -> int:
        """Version that generated the first response token (the oldest); staleness is measured from it."""
        return min(self.versions) if self.versions else -1

    def staleness(self, trainer_version: int) -> int:
        """Policy versions between generation and training: ``trainer_version - start_version``."""
        return trainer_version - self.start_version
