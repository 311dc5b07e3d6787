"""``BaseAlgorithm``: one optimizer step of the policy (and critic) from a rollout batch.

The algorithm owns the *loss side* of RL: micro-batching, proximal log-prob recompute,
the policy loss chosen by ``LossConfig``, the global-normaliser aggregation, gradient
clipping and the optimizer step. Advantages arrive precomputed in the batch (the
trainer runs ``advantages.compute_advantages(algo.default_estimator, ...)``).
Subclasses registered with ``@register_algorithm`` only choose defaults.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from areal_flow.algorithms.aggregation import aggregate_loss, step_normalisers
from areal_flow.algorithms.config import LossConfig, merged_loss_config
from areal_flow.algorithms.critic_update import critic_update
from areal_flow.algorithms.kl import kl_penalty
from areal_flow.algorithms.losses import behavior_importance_weight, compute_policy_loss, m2po_keep_mask
from areal_flow.algorithms.loss_scale import LossScaler, fp16_autocast
from areal_flow.algorithms.micro_batches import MicroBatch, plan_micro_batches, trimmed_width
from areal_flow.algorithms.model_runner import ModelRunner
from areal_flow.algorithms.step_metrics import StepMetrics

_REQUIRED = ("input_ids", "attention_mask", "loss_mask", "behavior_logprobs", "advantages")


class BaseAlgorithm:
    """Policy-gradient update with the loss chosen by ``LossConfig``.

    Class attributes set by subclasses:
        name: registry name (set by ``register_algorithm``).
        default_estimator: advantage estimator (key of ``advantages.ESTIMATORS``) the
            trainer should use for this algorithm.
        policy_loss: required ``LossConfig.policy_loss``, or None for any.
        loss_defaults: ``LossConfig`` overrides of ``default_loss_config()``.
        requires_critic: True when the graph must train a critic (its advantages read the
            critic's values); the graph validator checks it. The critic is stepped here
            only when passed in; a graph trains it in its own ``train_step`` node
            (:func:`critic_update`).

    Args:
        loss_cfg: the loss configuration.
        model: ``transformers`` causal LM being trained.
        optimizer: optimizer over ``model``'s parameters; stepped once per update.
        micro_batch_size: sequences per forward/backward pass (without a token budget).
        max_tokens_per_micro_batch: token budget of one forward/backward pass (dynamic
            micro-batches, ``algorithms.micro_batches``); 0 = ``micro_batch_size`` rows.
        pack_sequences: run the policy's forward passes on packed rows (no padding).
        shared_prefix: with ``pack_sequences``, rows of a micro-batch that begin with the same
            tokens run them once (``algorithms.shared_prefix``; same log-probs and gradient).
        max_grad_norm: global L2 norm the gradient is clipped to.
        temperature: sampling temperature; logits are divided by it so recomputed
            log-probs match the behavior log-probs of the engine.
        critic: value model, called ``critic(input_ids=, attention_mask=)`` and returning
            ``[batch, seq]`` values with ``values[b, t]`` = V(state before token t).
        critic_optimizer: optimizer over the critic's parameters.
        ref_model: frozen reference LM for the KL penalty (needed when ``kl_coef > 0``
            and the batch has no ``ref_logprobs``).

    Models should have dropout off (the LLM-RL convention): the proximal log-probs are
    recomputed in a separate no-grad pass and must equal the training forward's.

    The policy's forward and backward passes go through :attr:`runner`
    (``model_runner.ModelRunner``: the model on this process, one micro-batch at a time); a
    parallel trainer replaces it (``runtime.parallel``: pipeline stages, sequence chunks) and
    the loss, written per micro-batch from log-probs and entropy, stays the same.

    Raises:
        ValueError: a bad argument or a ``loss_cfg`` that contradicts the algorithm.
    """

    name: ClassVar[str] = "base"
    default_estimator: ClassVar[str] = "grpo"
    policy_loss: ClassVar[str | None] = None
    loss_defaults: ClassVar[dict[str, Any]] = {}
    requires_critic: ClassVar[bool] = False

    @classmethod
    def default_loss_config(cls, **overrides: Any) -> LossConfig:
        """``LossConfig`` with this algorithm's defaults, then ``overrides``.

        Raises:
            ValueError: an override key that is not a ``LossConfig`` field.
        """
        return merged_loss_config(cls.loss_defaults, overrides)

    def __init__(
        self,
        loss_cfg: LossConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        micro_batch_size: int,
        max_grad_norm: float,
        temperature: float = 1.0,
        critic: torch.nn.Module | None = None,
        critic_optimizer: torch.optim.Optimizer | None = None,
        ref_model: torch.nn.Module | None = None,
        max_tokens_per_micro_batch: int = 0,
        pack_sequences: bool = False,
        shared_prefix: bool = False,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size}: must be >= 1")
        if max_tokens_per_micro_batch < 0:
            raise ValueError(f"max_tokens_per_micro_batch={max_tokens_per_micro_batch}: must be >= 0 (0 = off)")
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm}: must be > 0")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature}: must be > 0")
        if self.policy_loss is not None and loss_cfg.policy_loss != self.policy_loss:
            raise ValueError(
                f"algorithm {self.name!r} uses policy_loss={self.policy_loss!r} but "
                f"loss_cfg.policy_loss={loss_cfg.policy_loss!r}"
            )
        if (critic is None) != (critic_optimizer is None):
            raise ValueError("critic and critic_optimizer must be given together")
        self.loss_cfg = loss_cfg
        self.model = model
        self.optimizer = optimizer
        self.micro_batch_size = micro_batch_size
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.critic = critic
        self.critic_optimizer = critic_optimizer
        self.ref_model = ref_model
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.pack_sequences = pack_sequences
        self.shared_prefix = shared_prefix
        self.runner = ModelRunner(model)
        self.loss_scaler: LossScaler | None = None  # made at the first step under fp16 autocast
        self.critic_loss_scaler: LossScaler | None = None  # the critic's, likewise

    # ----------------------------------------------------------------- helpers
    def _slices(self, batch_size: int) -> list[slice]:
        step = self.micro_batch_size
        return [slice(i, min(i + step, batch_size)) for i in range(0, batch_size, step)]

    def _micro_batches(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[MicroBatch]:
        """The policy's micro-batches of this step (``algorithms.micro_batches``)."""
        return plan_micro_batches(attention_mask, micro_batch_size=self.micro_batch_size,
                                  max_tokens=self.max_tokens_per_micro_batch, pack=self.pack_sequences,
                                  input_ids=input_ids if self.shared_prefix else None)

    def ref_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, scored_from: int = 0) -> torch.Tensor:
        """Reference-model log-probs ``[batch, seq]`` (no grad), e.g. to fold KL into the
        reward (``kl_in_reward``); ``scored_from`` as ``ModelRunner.logprobs`` (the LM head from
        column ``scored_from - 1`` on, 0 before ``scored_from``). Raises ``ValueError`` without a
        ``ref_model``."""
        if self.ref_model is None:
            raise ValueError(f"algorithm {self.name!r}: ref_logprobs needs ref_model")
        return ModelRunner(self.ref_model).logprobs(self._micro_batches(input_ids, attention_mask), input_ids,
                                                    attention_mask, self.temperature, scored_from)

    def compute_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Critic values ``[batch, seq]`` float32 (no grad), for GAE before the update."""
        if self.critic is None:
            raise ValueError(f"algorithm {self.name!r}: compute_values needs a critic")
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        with torch.no_grad():
            for sl in self._slices(input_ids.shape[0]):
                w = trimmed_width(attention_mask[sl])
                out[sl, :w] = self.critic(input_ids=input_ids[sl, :w], attention_mask=attention_mask[sl, :w]).float()
        return out

    def _validate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Checks the batch; returns the valid-token mask ``[batch, seq]`` bool."""
        need = list(_REQUIRED) + (["values", "returns"] if self.critic is not None else [])
        missing = [k for k in need if k not in batch]
        if missing:
            raise KeyError(f"algorithm {self.name!r}: batch lacks {missing} (has {sorted(batch)})")
        shape = batch["input_ids"].shape
        if len(shape) != 2 or batch["input_ids"].dtype != torch.int64:
            dtype = batch["input_ids"].dtype
            raise ValueError(f"batch['input_ids'] must be [batch, seq] int64, got {tuple(shape)} {dtype}")
        for k in need[1:] + [k for k in ("ref_logprobs",) if k in batch]:
            if batch[k].shape != shape:
                raise ValueError(f"batch[{k!r}] has shape {tuple(batch[k].shape)}, expected {tuple(shape)}")
        mask = batch["loss_mask"].bool()
        if bool((mask & ~batch["attention_mask"].bool()).any()):
            raise ValueError("batch['loss_mask'] is 1 on a position where attention_mask is 0 (padding)")
        if shape[1] and bool(mask[:, 0].any()):
            raise ValueError("batch['loss_mask'][:, 0] must be 0: the first token has no log-prob")
        for k in ("behavior_logprobs", "advantages") + (("values", "returns") if self.critic is not None else ()):
            if not bool(torch.isfinite(batch[k][mask]).all()):
                raise ValueError(f"batch[{k!r}] is not finite on a response token")
        return mask

    # ------------------------------------------------------------------ update
    def update_parameters(
        self,
        batch: dict[str, torch.Tensor],
        *,
        n_tokens: int | None = None,
        n_seqs: int | None = None,
        norm_length: int | None = None,
    ) -> dict[str, float]:
        """One optimizer step on ``batch`` (and one critic step when there is a critic).

        Args:
            batch: dict of tensors, ``[batch, seq]`` unless noted: ``input_ids`` int64
                (prompt + response, right-padded), ``attention_mask``, ``loss_mask`` (1 on
                response tokens, aligned with ``token_logprobs``), ``behavior_logprobs``
                (engine log-probs, natural log), ``advantages``; optional
                ``ref_logprobs``; ``values`` and ``returns`` when there is a critic.
                Other keys (``group_ids``, ``rewards``) are ignored.
            n_tokens: valid tokens in the whole step across data-parallel ranks (default:
                this batch's); the ``token-mean`` normaliser.
            n_seqs: sequences with >= 1 valid token across ranks (default: this batch's).
            norm_length: Dr.GRPO constant length when ``loss_cfg.loss_agg_norm_length``
                is None (default: the longest response of this batch).

        Returns:
            metrics (floats): ``loss`` (the step's total loss), ``policy_loss``,
            ``clip_frac`` (valid tokens whose gradient a clip/mask removed),
            ``importance_weight_mean``/``_max`` (pi_theta / pi_behav at the step start),
            ``kl_behavior_current`` (k3 estimate of KL(behavior || current), mean per
            token), ``behavior_logprob_abs_diff`` (mean |log pi_theta - log pi_behav|, nats),
            ``entropy`` (nats per token), ``grad_norm`` (before clipping),
            ``n_tokens``, ``n_seqs``, ``step_skipped`` (1 when no valid token or a
            non-finite gradient skipped the step); plus ``kl_ref`` with a KL loss,
            ``behavior_imp_weight_capped_frac`` when decoupled, ``value_loss``,
            ``value_clip_frac``, ``critic_grad_norm`` with a critic; under fp16 autocast
            (``model.dtype=float16``) ``loss_scale`` (the dynamic loss scale this step used,
            ``areal_flow.algorithms.loss_scale``) and ``loss_scale_overflow`` (1 when the scaled
            gradients overflowed with a finite loss: the step is skipped and the scale halved).

        Raises:
            KeyError: a required batch key is missing.
            ValueError: bad shapes/dtypes, loss_mask on padding, non-finite inputs, or a
                KL loss without reference log-probs.
        """
        cfg = self.loss_cfg
        mask = self._validate(batch)
        ids, attn = batch["input_ids"], batch["attention_mask"]
        behavior = batch["behavior_logprobs"].float()
        local_tokens, local_seqs, longest = step_normalisers(mask)
        norm = dict(
            n_tokens=local_tokens if n_tokens is None else n_tokens,
            n_seqs=local_seqs if n_seqs is None else n_seqs,
            norm_length=cfg.loss_agg_norm_length or norm_length or max(longest, 1),
        )
        scored = mask.any(dim=0).nonzero()  # the step's first response column: no loss reads one before it
        scored_from = int(scored[0]) if len(scored) else 0  # every pass runs the LM head from there on
        # The proximal policy is the one before this step's update (AReaL eq. 5): the current
        # weights. A step makes one optimizer update after every micro-batch's forward, so the
        # training forward's own log-probs (detached) are the proximal ones; only M2PO, whose
        # mask needs the whole batch before the first micro-batch, recomputes them up front.
        proximal = None
        if cfg.policy_loss == "m2po":
            proximal = self.runner.logprobs(self._micro_batches(ids, attn), ids, attn, self.temperature, scored_from)
        m2po_keep = None
        if cfg.policy_loss == "m2po":
            m2po_keep = m2po_keep_mask(proximal - behavior, mask, cfg.m2po_threshold)
        ref = None  # reference log-probs, only when the KL term is in the loss
        if cfg.kl_coef > 0 and not cfg.kl_in_reward:
            if "ref_logprobs" in batch:
                ref = batch["ref_logprobs"].float()
            elif self.ref_model is not None:
                ref = self.ref_logprobs(ids, attn, scored_from)
            else:
                raise ValueError("kl_coef > 0 with kl_in_reward=False needs batch['ref_logprobs'] or a ref_model")

        metrics = StepMetrics()
        self.optimizer.zero_grad(set_to_none=True)
        if self.loss_scaler is None and fp16_autocast(ids.device.type):
            self.loss_scaler = LossScaler(ids.device.type)
        scaler = self.loss_scaler if fp16_autocast(ids.device.type) else None

        def micro_batch_loss(mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
            prox, keep, ref_mb = (None if t is None else mb.take(t) for t in (proximal, m2po_keep, ref))
            if prox is None and cfg.use_decoupled_loss:
                prox = logp.detach()  # the weights before the update (above)
            loss = self._micro_batch_loss(batch, mb, logp, entropy, mask, behavior, prox, keep, ref_mb, norm, metrics)
            return loss if scaler is None else scaler.scaled(loss)

        self.runner.forward_backward(self._micro_batches(ids, attn), ids, attn, micro_batch_loss,
                                     temperature=self.temperature, entropy_grad=cfg.entropy_coef > 0,
                                     scored_from=scored_from)
        if scaler is not None:
            scaler.unscale(self.optimizer)
        grad_norm = self.runner.clip_grad_norm(self.max_grad_norm)
        skipped = norm["n_tokens"] == 0 or not bool(torch.isfinite(grad_norm))
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        result = metrics.result()
        result.update(grad_norm=float(grad_norm), n_tokens=float(local_tokens), n_seqs=float(local_seqs),
                      step_skipped=float(skipped))
        if scaler is not None:  # an overflow of the scaled gradients with a finite loss: the scale backs off
            result.update(loss_scale=scaler.scale, loss_scale_overflow=float(
                not bool(torch.isfinite(grad_norm)) and math.isfinite(result.get("loss", 0.0))))
            scaler.update()
        if self.critic is not None:
            result.update(self._update_critic(batch, mask, norm))
        return result

    def _micro_batch_loss(
        self,
        batch: dict[str, torch.Tensor],
        mb: MicroBatch,
        logp: torch.Tensor,
        ent: torch.Tensor,
        mask: torch.Tensor,
        behavior: torch.Tensor,
        proximal: torch.Tensor | None,
        m2po_keep: torch.Tensor | None,
        ref: torch.Tensor | None,
        norm: dict[str, Any],
        metrics: StepMetrics,
    ) -> torch.Tensor:
        """Micro-batch ``mb``'s share of the step loss: policy loss (+ KL) (- entropy bonus), from
        the policy's log-probs ``logp`` and entropy ``ent`` on its rows (``[b, w]``, with grad;
        ``ent`` with grad only under an entropy bonus). ``mask``/``behavior`` are the step's
        ``[B, T]``; the other tensors are already ``mb``'s ``[b, w]`` rows."""
        cfg = self.loss_cfg
        m, behav = mb.take(mask), mb.take(behavior)
        old = proximal if cfg.use_decoupled_loss else behav
        out = compute_policy_loss(cfg, logp, old, mb.take(batch["advantages"]), m, m2po_keep=m2po_keep)
        per_token = out.loss
        if cfg.use_decoupled_loss:
            weight, capped = behavior_importance_weight(
                proximal, behav, m, cap=cfg.behavior_imp_weight_cap,
                mode=cfg.behavior_imp_weight_mode, log_ratio_clamp=cfg.log_ratio_clamp,
            )
            per_token = per_token * weight
            metrics.add_count("behavior_imp_weight_capped_frac", capped, m)
        policy = aggregate_loss(per_token, m, cfg.loss_agg_mode, **norm)
        loss = policy
        if ref is not None:
            kl = kl_penalty(logp, ref, cfg.kl_estimator, loss_mask=m, log_ratio_clamp=cfg.log_ratio_clamp)
            loss = loss + cfg.kl_coef * aggregate_loss(kl, m, cfg.loss_agg_mode, **norm)
            metrics.add_mean("kl_ref", kl.detach(), m)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate_loss(ent, m, cfg.loss_agg_mode, **norm)
        metrics.add_total("loss", loss)
        metrics.add_total("policy_loss", policy)
        metrics.add_count("clip_frac", out.clipped, m)
        metrics.add_policy_drift(logp.detach(), behav, m, cfg.log_ratio_clamp)
        metrics.add_mean("entropy", ent.detach(), m)
        return loss

    def _update_critic(
        self, batch: dict[str, torch.Tensor], mask: torch.Tensor, norm: dict[str, Any]
    ) -> dict[str, float]:
        """One critic step on the clipped value loss, same aggregation as the policy."""
        assert self.critic is not None and self.critic_optimizer is not None
        device = batch["input_ids"].device.type
        if self.critic_loss_scaler is None and fp16_autocast(device):
            self.critic_loss_scaler = LossScaler(device)
        return critic_update(self.critic, self.critic_optimizer, batch, mask, norm, self.loss_cfg,
                             self._slices(batch["input_ids"].shape[0]), self.max_grad_norm,
                             scaler=self.critic_loss_scaler if fp16_autocast(device) else None)
