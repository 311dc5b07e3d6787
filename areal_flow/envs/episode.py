"""One multi-turn episode as tokens: observations, policy turns, turn rewards.

Owns the token layout of a multi-turn trajectory, shared by the rollout loop
(``runtime.executors.episode_runner``), the OpenAI-compatible endpoint and the supervised warm
start on scripted dialogues (:func:`encode_dialogue`), so what a model is warm-started on
is exactly what it later sees:

* no chat template (the character tokenizer): the first observation is
  ``tokenizer.encode(text)`` (``<bos>`` + characters, as ``ops.generate`` lays out a
  prompt), every later one ``encode(text, add_special_tokens=False)`` followed by EOS
  (:data:`LAYOUT_VERSION` 2); a policy turn is the sampled ids, ending with EOS when it
  stopped. So every message after the prompt ends with EOS, as ChatML ends every message
  with ``<|im_end|>``: the token before every policy turn after the first is an EOS, and
  after an observation the policy has never seen (an error message) it still knows that
  its turn has begun. Layout 1 had no marker, and a tiny policy continued unfamiliar
  observations' text as if it were its own (docs/AGENTS.md, "Where the turns went"). The
  layout holds for any tokenizer without a chat template, so an agent program's later
  messages (``graphs/arith_openai_agent.py``'s ``"again="``) end with EOS too.
* a chat template: observations are chat messages (a text becomes one ``user`` message);
  each one is tokenised as the *difference* between the template rendered with and
  without it (:func:`render_delta`), so the policy's sampled ids are never re-tokenised.

Policy tokens keep their behavior log-prob and the policy version that sampled them and
have ``loss_mask`` 1; observation tokens have log-prob 0, version -1 and ``loss_mask`` 0.
Every token carries the index of its turn (observation tokens: the turn they follow,
the first observation is the prompt), so per-turn rewards can be credited
(``areal_flow.algorithms.returns.multi_turn``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_flow.types import Trajectory

LAYOUT_VERSION = 2
"""The no-chat token layout (module doc); part of the warm-start cache key, so a model
warm-started on another layout is never reused."""


def _messages(obs) -> list[dict]:
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    if isinstance(obs, dict):
        return [obs]
    return list(obs)


def render_delta(tokenizer, history: list[dict], new: list[dict], tools: list[dict] | None = None,
                 policy_text: str = "") -> list[int]:
    """Token ids that the chat template adds to ``history`` for ``new`` messages plus the
    opening of the next assistant turn.

    ``history`` ends with the assistant message whose sampled ids are already in the
    context (decoded *with* special tokens as ``policy_text``); the template may close that
    turn with more text than the policy sampled (``"<|im_end|>\\n"`` after a sampled
    ``<|im_end|>``): that remainder belongs to the observation.

    Returns:
        ``[delta_len]`` token ids (no special tokens added by the tokenizer itself).
    """
    kw = {"tools": tools} if tools else {}
    base = tokenizer.apply_chat_template(history[:-1], tokenize=False, add_generation_prompt=True, **kw)
    full = tokenizer.apply_chat_template(history + new, tokenize=False, add_generation_prompt=True, **kw)
    tail = full[len(base):] if full.startswith(base) else full
    if policy_text and tail.startswith(policy_text):
        tail = tail[len(policy_text):]
    else:  # the template rewrote the assistant turn: keep what follows its rendering
        upto = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=False, **kw)
        tail = full[len(upto):] if full.startswith(upto) else tail
    return list(tokenizer.encode(tail, add_special_tokens=False))


@dataclass
class Episode:
    """Accumulates one episode; ``to_trajectory`` turns it into the experience record.

    Attributes:
        chat: render observations with the tokenizer's chat template.
        tools: the env's tool list (rendered by the chat template).
        prompt_ids: ``[prompt_len]``: the first observation.
        output_ids / logprobs / versions / loss_mask / turn_ids: one entry per token after
            the prompt (module doc).
        turn_rewards: one reward per policy turn.
        messages: the conversation as chat messages (chat mode).
    """

    tokenizer: object
    chat: bool
    tools: list[dict] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reason: str = "stop"

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def n_turns(self) -> int:
        return len(self.turn_rewards)

    def observe(self, obs) -> None:
        """Append an observation (the first one becomes the prompt)."""
        first = not self.prompt_ids
        if self.chat:
            new = _messages(obs)
            if first:
                kw = {"tools": self.tools} if self.tools else {}
                text = self.tokenizer.apply_chat_template(new, tokenize=False, add_generation_prompt=True, **kw)
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            else:
                policy_text = self.tokenizer.decode(self._last_policy_ids(), skip_special_tokens=False)
                ids = render_delta(self.tokenizer, self.messages, new, self.tools, policy_text)
            self.messages.extend(new)
            self.texts.append(" ".join(str(m.get("content", "")) for m in new))
        else:
            text = obs if isinstance(obs, str) else " ".join(str(m.get("content", "")) for m in _messages(obs))
            ids = list(self.tokenizer.encode(text)) if first else _later_observation(self.tokenizer, text)
            self.texts.append(text)
        if first:
            self.prompt_ids = ids
            return
        turn = max(self.n_turns - 1, 0)
        self.output_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.turn_ids += [turn] * len(ids)

    def _last_policy_ids(self) -> list[int]:
        turn = self.n_turns - 1
        return [t for t, m, k in zip(self.output_ids, self.loss_mask, self.turn_ids) if m and k == turn]

    def act(self, ids: list[int], logprobs: list[float], versions: list[int], text: str, finish_reason: str) -> None:
        """Append a policy turn (sampled ids with their log-probs and versions); its reward
        starts at 0 (:meth:`reward` sets it)."""
        turn = self.n_turns
        self.output_ids += list(ids)
        self.logprobs += list(logprobs)
        self.versions += list(versions)
        self.loss_mask += [1] * len(ids)
        self.turn_ids += [turn] * len(ids)
        self.turn_rewards.append(0.0)
        self.finish_reason = finish_reason
        if self.chat:
            self.messages.append({"role": "assistant", "content": text})
        self.texts.append(text)

    def reward(self, value: float) -> None:
        """Add ``value`` to the reward of the latest policy turn."""
        if not self.turn_rewards:
            raise ValueError("a reward before the policy's first turn")
        self.turn_rewards[-1] += float(value)

    def episode_return(self, gamma: float) -> float:
        """``G_0 = sum_k gamma^k R_k`` (Sutton & Barto 2018, eq. 3.8, one step per turn)."""
        return sum(r * gamma**k for k, r in enumerate(self.turn_rewards))

    def to_trajectory(self, sample_id: str, group_id: int, gamma: float, meta: dict) -> Trajectory:
        """The experience record; ``reward`` = :meth:`episode_return`."""
        return Trajectory(
            sample_id=sample_id, group_id=group_id, prompt_ids=list(self.prompt_ids), output_ids=list(self.output_ids),
            behavior_logprobs=list(self.logprobs), versions=list(self.versions), finish_reason=self.finish_reason,
            prompt_text=self.texts[0] if self.texts else "", output_text="\n".join(self.texts[1:]),
            reward=self.episode_return(gamma), meta=meta, loss_mask=list(self.loss_mask),
            turn_ids=list(self.turn_ids), turn_rewards=list(self.turn_rewards))


def _later_observation(tokenizer, text: str) -> list[int]:
    """An observation after the first, no chat template: its tokens, then EOS.

    Raises:
        ValueError: the tokenizer has no ``eos_token_id`` (the layout needs one).
    """
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{type(tokenizer).__name__} has no eos_token_id: a multi-turn episode without a chat "
                         "template ends every later observation with EOS; set the tokenizer's eos_token")
    return list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]


def encode_dialogue(tokenizer, segments: list[tuple]) -> tuple[list[int], list[int]]:
    """A scripted dialogue in the rollout's token layout (no chat template), for SFT.

    Args:
        segments: ``(text, is_policy)`` or ``(text, is_policy, is_target)`` in order,
            starting with an observation; a policy turn is followed by EOS, as a sampled
            turn that stopped. ``is_target`` False keeps a policy turn in the context but
            out of the loss (a slip the dialogue recovers from, which the model should
            learn to recover from, not to make).

    Returns:
        ``(ids, loss_mask)``, ``[len]`` each; ``loss_mask`` is 1 on the tokens of target
        policy turns and their EOS.
    """
    ids: list[int] = []
    mask: list[int] = []
    for text, is_policy, *target in segments:
        if is_policy:
            seg = list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
        else:
            seg = _later_observation(tokenizer, text) if ids else list(tokenizer.encode(text))
        ids += seg
        mask += [int(is_policy and (not target or bool(target[0])))] * len(seg)
    return ids, mask
