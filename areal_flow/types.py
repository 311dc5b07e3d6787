"""The values that travel on the experience channel: trajectories and their groups.

Owns the plain record of one sample; no tensors live here so a record pickles small and
crosses processes cheaply. The port values that hold them (a group's ``Rollouts``, ...) are
``areal_flow.values``; tensors are built by the trainer's collate step (``areal_flow.batching``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

REPLAYED = "replayed_from_step"
"""``Trajectory.meta`` key of a sample trained again by a replay node (``ops.replay``): the
step that first trained it. A trajectory log line without it is a fresh sample (each trained
exactly once)."""


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
        reward: scalar reward, filled by the ``reward`` node (a multi-turn episode: its
            discounted return ``sum_k gamma^k R_k``).
        meta: task data (e.g. the reference answer), never used by the trainer.
        loss_mask: multi-turn only, ``[response_len]``: 1 on tokens the policy sampled, 0 on
            observation (env, tool, user) tokens between turns; None = every response
            token is the policy's. Observation tokens have log-prob 0 and version -1.
        turn_ids: multi-turn only, ``[response_len]``: the turn index of each token.
        turn_rewards: multi-turn only, ``[n_turns]``: the env's reward for each policy turn.
        correct: whether the response is right, as the task judges it, independent of the
            reward (which shaping, penalties or user ops may change): a single response, the
            dataset task's ``correct(output_text, answer)``; an episode, its env's
            ``success`` (or ``resolved``) info > 0, an agent program's return > 0 (as the
            held-out episode success rate). None: the task cannot tell (an env task without
            such info). The run's ``accuracy`` is the mean over the judged samples.
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
    loss_mask: list[int] | None = None
    turn_ids: list[int] | None = None
    turn_rewards: list[float] | None = None
    correct: bool | None = None

    @property
    def start_version(self) -> int:
        """Version that generated the first policy token (the oldest); staleness is measured from it."""
        sampled = [v for v in self.versions if v >= 0]
        return min(sampled) if sampled else -1

    def staleness(self, trainer_version: int) -> int:
        """Policy versions between generation and training: ``trainer_version - start_version``."""
        return trainer_version - self.start_version
