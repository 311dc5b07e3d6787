"""The policy's learning rate per train step: a linear warm-up to ``train.lr``, then constant.

``train.lr_warmup_steps`` (W, verl's ``optim.lr_warmup_steps``, HF's ``warmup_steps``) ramps the
AdamW learning rate of every train_step (the policy's and a critic's; one process or several
ranks) over its first W optimizer steps::

    lr(t) = train.lr * min(1, (t + 1) / W)      t = 0, 1, ... the train step (policy version)

so step W - 1 is the first at the full rate. (HF's ``get_constant_schedule_with_warmup``
uses ``t / W``, whose first step has lr 0; here the first step already moves the weights by
``lr / W``.) W = 0: ``train.lr`` from the first step. The rate depends on the step alone, so a
resumed run continues its ramp where the checkpoint left it.
"""

from __future__ import annotations


def warmup_lr(lr: float, warmup_steps: int, step: int) -> float:
    """The learning rate of train step ``step`` (0-based): ``lr * min(1, (step + 1) / warmup_steps)``,
    ``lr`` when ``warmup_steps`` is 0.

    Raises:
        ValueError: ``warmup_steps`` or ``step`` < 0."""
    if warmup_steps < 0 or step < 0:
        raise ValueError(f"warmup_lr: warmup_steps={warmup_steps} and step={step} must be >= 0")
    if warmup_steps == 0:
        return lr
    return lr * min(1.0, (step + 1) / warmup_steps)


def set_lr(optimizer, lr: float) -> None:
    """Set every param group of ``optimizer`` (a ``torch.optim.Optimizer``) to ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
