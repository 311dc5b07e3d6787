"""Accumulates one optimizer step's metrics over its micro-batches (token-weighted)."""

from __future__ import annotations

import torch

from areal_flow.algorithms.kl import kl_penalty


class StepMetrics:
    """Sums numerators and denominators per metric; ``result()`` divides once, so a
    per-token mean over 2 micro-batches equals the mean over 1 batch."""

    def __init__(self) -> None:
        self._total: dict[str, float] = {}
        self._num: dict[str, float] = {}
        self._den: dict[str, float] = {}
        self._max: dict[str, float] = {}

    def _acc(self, name: str, num: float, den: float) -> None:
        self._num[name] = self._num.get(name, 0.0) + num
        self._den[name] = self._den.get(name, 0.0) + den

    def add_total(self, name: str, value: torch.Tensor) -> None:
        """A quantity that adds up across micro-batches (e.g. the aggregated loss)."""
        self._total[name] = self._total.get(name, 0.0) + float(value.detach())

    def add_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Per-token mean of ``values [batch, seq]`` over ``mask``."""
        m = mask.bool()
        self._acc(name, float(values.double()[m].sum()), float(m.sum()))

    def add_count(self, name: str, flags: torch.Tensor, mask: torch.Tensor) -> None:
        """Fraction of valid tokens where ``flags [batch, seq]`` (bool) is True."""
        m = mask.bool()
        self._acc(name, float((flags.bool() & m).sum()), float(m.sum()))

    def add_policy_drift(
        self, logprobs: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, clamp: float
    ) -> None:
        """``importance_weight_mean``/``_max`` = pi_theta/pi_behav,
        ``kl_behavior_current`` = k3 estimate of KL(behavior || current) and
        ``behavior_logprob_abs_diff`` = mean ``|log pi_theta - log pi_behav|`` (nats), per valid
        token: the engine's precision mismatch plus the policy's drift over the sample's staleness."""
        m = mask.bool()
        self.add_mean("behavior_logprob_abs_diff", (logprobs.float() - behavior.float()).abs(), m)
        ratio = torch.exp((logprobs.float() - behavior.float()).clamp(-clamp, clamp))[m]
        self._acc("importance_weight_mean", float(ratio.double().sum()), float(m.sum()))
        if ratio.numel():
            self._max["importance_weight_max"] = max(self._max.get("importance_weight_max", 0.0), float(ratio.max()))
        kl = kl_penalty(behavior, logprobs, "k3", loss_mask=m, log_ratio_clamp=clamp)
        self.add_mean("kl_behavior_current", kl, m)

    def result(self) -> dict[str, float]:
        """Totals as sums, means as num/den (0 when nothing was counted)."""
        out = dict(self._total)
        out.update({k: (v / self._den[k] if self._den[k] > 0 else 0.0) for k, v in self._num.items()})
        out.update(self._max)
        out.setdefault("importance_weight_max", 0.0)
        return out
