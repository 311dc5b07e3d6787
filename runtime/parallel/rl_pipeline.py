"""The RL algorithm's passes through a pipeline of stages (``torch.distributed.pipelining``).

Under ``pp > 1`` each rank holds one stage (``pipeline.split_stage``); only the last stage
sees logits, so the policy loss runs there, as the schedule's loss function, one micro-batch at
a time: the step's micro-batches (the plan's count per DP rank, rows in batch order) are
stacked into one ``[n * rows, width]`` batch that the schedule splits back into ``n`` equal
micro-batches, and the target the schedule hands the loss is each micro-batch's row indices.
The last stage turns the logits of a micro-batch into its log-probs and entropy
(``model_runner.kept_token_outputs``) and calls the algorithm's loss on them
(``BaseAlgorithm``'s, whichever algorithm: the loss never sees the pipeline), and the schedule
back-propagates that loss through the stages (1F1B: Narayanan et al. 2019, PipeDream-Flush: at
most ``pp`` micro-batches' activations in flight on the first stage). Log-probs without gradient
(M2PO's proximal policy, for its mask) run the same schedule forward only (``schedule.eval``),
the last stage writing each micro-batch's log-probs into a ``[B, T]`` tensor.

Why the micro-batches are padded to one shape: the schedule's stages exchange activations of a
fixed shape, given to ``PipelineStage`` up front (its static mode: no trial forward and
backward to infer them). A step's micro-batches share ``rows`` (the plan's micro-batch size:
a shorter last one is padded with empty rows, which carry no loss) and ``width`` (the step's
longest row: right padding, which causal attention keeps out of every real token's output).
A new shape builds a new stage and schedule (no communication beyond a 1-element vote).
Packed micro-batches (``train.pack_sequences``) run padded here, with the same values.

In both passes the last stage runs the LM head only from the step's first response column on
(``scored_from``, as ``ModelRunner``'s passes; ``model_runner.head_skip``): the stage's
``head_from``, one column for every micro-batch of the step (the schedule's output shape is
fixed), part of the schedule's shape. Every stage of a pipeline holds the same rows, so all agree
on it, and a step's two passes share one schedule.

After the backward the tied embedding's two copies sum their gradients
(``pipeline.sync_tied_embedding_grads``) and the gradient norm adds the stages' squares over
the pipeline group (``grad_norm``), counting the tied matrix once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from areal_flow.algorithms.micro_batches import MicroBatch
from areal_flow.algorithms.model_runner import MicroBatchLoss, head_skip, kept_token_outputs
from runtime.parallel.apply import ParallelModel
from runtime.parallel import signed_objects
from runtime.parallel.pipeline import sync_tied_embedding_grads, tied_embedding
from runtime.parallel.rl_runner import ShardedRunner, right_padded

ValuesFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``fn(mb, log-probs [b, w], entropy [b, w] or None) -> 0-dim loss`` of micro-batch ``mb`` (last stage)."""


class PipelineRunner(ShardedRunner):
    """The algorithm's passes through this rank's stage of a ``pp > 1`` policy.

    Every rank of the pipeline calls each method with the same arguments (the whole step batch:
    every stage holds it), in the same order. Collectives: the schedule's point-to-point
    exchanges over ``mesh["pp"]``, the tied-embedding sum, the gradient norm.

    Args:
        parallel: this rank's stage (``parallelize`` with ``ParallelConfig(n_microbatches=None)``).
    """

    def __init__(self, parallel: ParallelModel) -> None:
        super().__init__(parallel)
        self.stage = parallel.module
        self.pp_group = parallel.mesh["pp"].get_group()
        # the schedules of the last two shapes (a step's no-grad log-probs and training pass share one)
        self._built: dict[tuple[int, int, int, int], PipelineScheduleSingle] = {}
        self._on_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    # ---------------------------------------------------------------- schedule
    def _schedule(self, rows: int, width: int, n_micro: int, head_from: int,
                  device: torch.device) -> PipelineScheduleSingle:
        """The schedule for ``n_micro`` micro-batches of ``[rows, width]`` tokens, the LM head from
        column ``head_from`` on (cached per shape)."""
        key = (rows, width, n_micro, head_from)
        if key in self._built:
            return self._built[key]
        stage, config = self.stage, self.stage.config
        dtype = next(stage.parameters()).dtype  # the residual stream: fp32 master weights, also under autocast
        # requires_grad: the activations (and so their gradients) cross the stage boundary
        hidden = torch.empty((rows, width, config.hidden_size), dtype=dtype, device="meta", requires_grad=True)
        inputs = torch.empty((rows, width), dtype=torch.int64, device="meta") if stage.is_first else hidden
        outputs = (torch.empty((rows, width - head_from, config.vocab_size), dtype=dtype, device="meta")
                   if stage.is_last else hidden)
        pp_mesh = self.parallel.mesh["pp"]
        pipeline_stage = PipelineStage(stage, pp_mesh.get_local_rank(), pp_mesh.size(), device, input_args=inputs,
                                       output_args=outputs, group=self.pp_group)
        schedule = Schedule1F1B(pipeline_stage, n_microbatches=n_micro, loss_fn=self._loss, scale_grads=False)
        self._built = {**dict(list(self._built.items())[-1:]), key: schedule}
        return schedule

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function (last stage): ``target`` holds the micro-batch's row indices."""
        return self._on_logits(logits, target)

    def _run(self, micro_batches: list[MicroBatch], input_ids: torch.Tensor, attention_mask: torch.Tensor,
             fn: ValuesFn, *, temperature: float, scored_from: int, entropy_grad: bool | None, train: bool) -> None:
        """Run the schedule over ``micro_batches`` (run padded: ``right_padded``), the last stage's
        LM head from column ``head_skip(scored_from, the narrowest width)`` on; on the last stage
        ``fn`` gets each one's values (``kept_token_outputs`` of its real rows, its own width ``w``)
        and returns its loss. ``train``: ``schedule.step`` (backward too), else ``schedule.eval``."""
        micro_batches = right_padded(micro_batches, attention_mask)
        head_from = head_skip(scored_from, min(mb.width for mb in micro_batches))
        n_micro = len(micro_batches)
        if n_micro < self.parallel.strategy.pp:
            raise ValueError(f"the 1F1B schedule needs at least pp={self.parallel.strategy.pp} micro-batches, "
                             f"got {n_micro}")
        rows = max(len(mb.rows) for mb in micro_batches)
        width = max(mb.width for mb in micro_batches)
        device = input_ids.device
        stacked = torch.zeros((n_micro * rows, width), dtype=input_ids.dtype, device=device)
        target = torch.full((n_micro * rows,), -1, dtype=torch.int64, device=device)
        by_first_row = {}
        for i, mb in enumerate(micro_batches):
            picked = torch.tensor(mb.rows, device=device)
            stacked[i * rows : i * rows + len(mb.rows)] = input_ids[picked, :width]
            target[i * rows : i * rows + len(mb.rows)] = picked
            by_first_row[mb.rows[0]] = mb

        def on_logits(logits: torch.Tensor, rows_of: torch.Tensor) -> torch.Tensor:
            mb = by_first_row[int(rows_of[0])]
            kept = logits[: len(mb.rows), : mb.width - head_from]
            return fn(mb, *kept_token_outputs(kept, mb.take(input_ids), temperature, head_from,
                                              entropy_grad=entropy_grad))

        schedule = self._schedule(rows, width, n_micro, head_from, device)
        args = (stacked,) if self.stage.is_first else ()
        kwargs = dict(target=target if self.stage.is_last else None, return_outputs=False)
        self._on_logits = on_logits
        self.stage.head_from = head_from
        try:
            if train:
                schedule.step(*args, **kwargs)
            else:
                with torch.no_grad():
                    schedule.eval(*args, **kwargs)
        finally:
            self._on_logits = None

    # ------------------------------------------------------------- the runner
    def logprobs(self, micro_batches: list[MicroBatch], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 temperature: float, scored_from: int = 0) -> torch.Tensor:
        """No-grad log-probs ``[B, T]`` float32, filled on the last stage (zeros on the others,
        which never read them: the loss runs on the last stage). ``scored_from``: as
        :meth:`forward_backward` (0 up to column ``scored_from - 1``)."""
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)

        def record(mb: MicroBatch, logp: torch.Tensor, _: None) -> torch.Tensor:
            mb.put(out, logp)
            return logp.new_zeros(())

        self._run(micro_batches, input_ids, attention_mask, record, temperature=temperature, scored_from=scored_from,
                  entropy_grad=None, train=False)
        return out

    def forward_backward(self, micro_batches: list[MicroBatch], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         loss_fn: MicroBatchLoss, *, temperature: float, entropy_grad: bool,
                         scored_from: int = 0) -> None:
        """The step's gradient through the pipeline schedule, ``loss_fn`` on the last stage; then
        the tied embedding's gradients summed and the experts' over their replicas.
        ``scored_from``: as :meth:`ModelRunner.forward_backward`; the last stage's LM head runs
        from column ``scored_from - 1`` on (at most the narrowest micro-batch's last column), the
        columns before hold 0, as ``ModelRunner``'s."""
        self._run(micro_batches, input_ids, attention_mask, loss_fn, temperature=temperature, scored_from=scored_from,
                  entropy_grad=entropy_grad, train=True)
        sync_tied_embedding_grads(self.stage, self.parallel.tied_group)
        self.reduce_expert_gradients()

    def clip_grad_norm(self, max_norm: float, **where) -> torch.Tensor:
        """Clip to the global norm over all stages (the tied matrix counted once, on the first stage)."""
        duplicate = tied_embedding(self.stage) if self.stage.is_last else None
        return super().clip_grad_norm(max_norm, pp_group=self.pp_group,
                                      counted_elsewhere=[duplicate] if duplicate is not None else [])

    def broadcast_from_last_stage(self, stats: dict[str, float]) -> dict[str, float]:
        """The last stage's ``stats`` on every stage of this pipeline (a collective of the pp group)."""
        last = dist.get_global_rank(self.pp_group, self.parallel.mesh["pp"].size() - 1)
        return signed_objects.broadcast(stats, src=last, channel="pp_stats", group=self.pp_group)
