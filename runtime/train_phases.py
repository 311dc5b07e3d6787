"""The phases of one train step on the timeline: forward, backward and optimizer spans.

Owns :class:`TrainPhaseSpans`: PyTorch hooks on a train_step's model and optimizer that, while
the step is :meth:`~TrainPhaseSpans.active`, record one span per phase in the trainer's track
(``runtime.trace``), nested inside the step's ``train_step`` span. The algorithms
(``areal_flow.algorithms``) need not know of the timeline: the hooks see every micro-batch
whatever loop runs it. Spans are named by the node (``train_step``), category ``phase``, with
``args.phase``:

* ``forward`` — micro-batch ``args.micro_batch`` (0, 1, ... in order): from the model's
  forward pre-hook (``torch.nn.Module.register_forward_pre_hook``) to the start of its
  backward, i.e. the model and the loss; a no-grad forward (M2PO's proximal or the reference
  log-probs computed before the update) is its own ``forward`` span with ``args.grad``
  false that ends with the model's forward hook;
* ``backward`` — from the moment autograd reaches the model's output (a tensor hook on it,
  ``torch.Tensor.register_hook``) to the end of that ``backward()`` call (a callback queued on
  the autograd engine, run when the graph task finishes);
* ``optimizer`` — ``optimizer.step()`` (``torch.optim.Optimizer.register_step_pre_hook`` /
  ``register_step_post_hook``); absent when the step was skipped (no valid token, non-finite
  gradient). Gradient clipping sits between the last backward and this span.

Not split: a multi-rank train_step (the ranks run the loop in their own processes).
"""

from __future__ import annotations

import contextlib

import torch

from runtime.trace import TraceRecorder, now_us


def _output_tensor(out) -> torch.Tensor | None:
    """The tensor of a model's output that the loss is built from (``logits`` of a Hugging Face
    output, the tensor itself, or the first tensor of a tuple/dict); None when there is none."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


class TrainPhaseSpans:
    """Forward/backward/optimizer spans of one train_step node (module doc).

    Args:
        model: the module the step trains (its forward is timed).
        optimizer: the optimizer whose ``step`` is timed.
        node: the train_step node's name, the spans' name.

    The hooks stay installed for the executor's life and record only inside :meth:`active`
    with an enabled recorder, so a shared model's forwards outside the step (another node)
    are not counted.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, node: str) -> None:
        self.node = node
        self._trace: TraceRecorder | None = None
        self._info: dict = {}
        self._micro_batch = 0
        self._forward_us: int | None = None  # start of the open forward span
        self._optimizer_us: int | None = None
        model.register_forward_pre_hook(self._forward_pre)
        model.register_forward_hook(self._forward_post)
        optimizer.register_step_pre_hook(self._optimizer_pre)
        optimizer.register_step_post_hook(self._optimizer_post)

    @contextlib.contextmanager
    def active(self, trace: TraceRecorder | None, track: str = "step", **args):
        """Record the phases of the ``with`` body in ``trace`` (None or disabled: nothing), on
        ``track``, each span's args extended by ``args`` (e.g. ``step=3``)."""
        on = trace is not None and trace.enabled
        self._trace, self._track, self._info, self._micro_batch = (trace if on else None), track, args, 0
        try:
            yield
        finally:
            self._trace, self._forward_us, self._optimizer_us = None, None, None

    def _span(self, phase: str, start: int, **extra) -> None:
        self._trace.complete(self.node, self._track, start, now_us(), cat="phase", phase=phase, **self._info, **extra)

    def _forward_pre(self, module, args) -> None:
        if self._trace is not None:
            self._forward_us = now_us()

    def _forward_post(self, module, args, out) -> None:
        if self._trace is None or self._forward_us is None:
            return
        logits = _output_tensor(out)
        if not torch.is_grad_enabled() or logits is None or not logits.requires_grad:
            self._span("forward", self._forward_us, grad=False)
            self._forward_us = None
            return
        started, micro_batch = self._forward_us, self._micro_batch
        self._forward_us, self._micro_batch = None, micro_batch + 1
        logits.register_hook(lambda grad: self._backward_started(started, micro_batch))

    def _backward_started(self, forward_us: int, micro_batch: int) -> None:
        if self._trace is None:
            return
        self._span("forward", forward_us, grad=True, micro_batch=micro_batch)
        started = now_us()

        def finished() -> None:
            if self._trace is not None:
                self._span("backward", started, micro_batch=micro_batch)

        torch.autograd.Variable._execution_engine.queue_callback(finished)

    def _optimizer_pre(self, optimizer, args, kwargs) -> None:
        if self._trace is not None:
            self._optimizer_us = now_us()

    def _optimizer_post(self, optimizer, args, kwargs) -> None:
        if self._trace is not None and self._optimizer_us is not None:
            self._span("optimizer", self._optimizer_us)
            self._optimizer_us = None
