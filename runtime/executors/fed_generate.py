"""A generate node fed by a per-group node (an LLM judge, a teacher): run per prompt group.

Owns :class:`FedGenerateExecutor`, what a worker runs for a ``stream`` node whose prompts a
per-group node builds from the policy's rollouts (``runtime.topology.judge_nodes``) instead
of the dataset: a ``group``-grain executor over the node's own engine
(``runtime.executors.generate.GenerateExecutor``, built in the worker group that hosts the
node: a mesh of its own, ``compile.allocation="gen:d1 + judge:d1 + train:d1"``). Each group's
prompts (one per sample of the policy's group, port type ``prompts``) are generated to the
end before the group moves on; the responses come back as ``rollouts``, one per prompt, in
the prompts' order, so a reward of them lines up with the policy's samples.

Its model is frozen (``compiler.hosting`` rule ``frozen-judge``; no weight route reaches it,
``runtime.topology``): the engine keeps version 0 for the whole run, so the judge has no
versions and takes no part in the staleness bound (``runtime.staleness`` bounds the policy's
tokens only). A prompt whose response the engine refused or left empty drops the group (its
batch slot is resampled, as after a filter): a partial verdict would shift the group's
baseline.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from areal_flow.values import PortValueError, Rollouts


class FedGenerateExecutor:
    """Grain ``group`` over a stream executor (module doc).

    Args:
        stream: the node's ``GenerateExecutor`` (its engine built in this worker).
    """

    def __init__(self, stream: Any) -> None:
        self.stream, self.node = stream, stream.node

    def run(self, inputs: dict, info: dict) -> dict | None:
        """Generate one response per prompt of the group.

        Args:
            inputs: ``prompts``: a list of prompts (``areal_flow.values.Prompt``), one per
                sample of the group (one prompt: a list of one).
            info: ``index`` (the group's admission index), ``attempt`` and ``samples`` (the
                group's trajectories; not checked when absent).

        Returns:
            ``{"rollouts": Rollouts}`` of ``len(prompts)`` trajectories (``group_id`` the
            group's index, ``sample_id`` ``"<index>:<j>"``), or None to drop the group when a
            response failed or was empty (module doc).

        Raises:
            PortValueError: not one prompt per sample of the group (naming the node).
        """
        prompts = inputs["prompts"]
        prompts = [prompts] if isinstance(prompts, dict) else list(prompts)
        samples = info.get("samples")
        if samples is not None and len(prompts) != samples:
            raise PortValueError(f"{self.node.where()}: {len(prompts)} prompts for a group of {samples} samples; the "
                                 "per-group node feeding it builds one prompt per sample, in the group's order")
        for j, prompt in enumerate(prompts):
            self.stream.submit(j, 1, prompt)
        finished: dict[int, Rollouts] = {}
        while self.stream.has_work():
            finished.update({j: rollouts for j, _, rollouts in self.stream.step()})
        if any(len(finished.get(j, ())) != 1 for j in range(len(prompts))):
            return None
        index, attempt = info.get("index", 0), info.get("attempt", 1)
        return {"rollouts": Rollouts([replace(finished[j][0], group_id=index, sample_id=f"{index}:{j}",
                                              meta={**finished[j][0].meta, "attempt": attempt})
                                      for j in range(len(prompts))])}
