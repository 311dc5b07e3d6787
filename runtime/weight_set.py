"""The tensor set of a weight version: its names, shapes and dtypes, checked before a load.

Owns the rule that a policy version touches an engine only whole and well-formed: the
weight channel (``runtime.weight_subscriber.WeightSubscriber``) holds a version back unless its
tensor set equals the one of the first version it returned (names, shapes, dtypes), and an
engine (``runtime.engines.generation.GenerationEngine.update_weights``) loads nothing
unless every one of its parameters and buffers is present with its shape. Without the
check, ``torch.nn.Module.load_state_dict`` copies tensor after tensor and reports a wrong
shape or a missing name only at the end, leaving the model with mixed old and new weights
under the old version label. Must not: receive or load weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

TensorSet = dict[str, tuple[tuple[int, ...], torch.dtype]]
_SHOWN = 3  # differences named per kind in a message


class TensorSetError(ValueError):
    """A weight version's tensor set differs from the expected one (names every kind of
    difference: missing, unexpected, shape, dtype; a few names each)."""


def tensor_set(state: Mapping[str, torch.Tensor]) -> TensorSet:
    """``{name: (shape, dtype)}`` of a state dict."""
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(repr(n) for n in names[:_SHOWN]) + more


def differences(expected: TensorSet, state: Mapping[str, torch.Tensor], *, dtypes: bool = True) -> list[str]:
    """What differs between ``expected`` and ``state``'s tensor set, one phrase per kind
    (empty when they match). ``dtypes=False`` compares names and shapes only."""
    got = tensor_set(state)
    out = []
    missing = [n for n in expected if n not in got]
    unexpected = [n for n in got if n not in expected]
    shapes = [n for n in expected if n in got and got[n][0] != expected[n][0]]
    kinds = [n for n in expected if n in got and dtypes and got[n][1] != expected[n][1]]
    if missing:
        out.append(f"missing {_names(missing)}")
    if unexpected:
        out.append(f"unexpected {_names(unexpected)}")
    if shapes:
        out.append("shape of " + ", ".join(f"{n!r} {list(got[n][0])} (expected {list(expected[n][0])})"
                                           for n in shapes[:_SHOWN]) + (f" and {len(shapes) - _SHOWN} more"
                                                                         if len(shapes) > _SHOWN else ""))
    if kinds:
        out.append("dtype of " + ", ".join(f"{n!r} {str(got[n][1]).removeprefix('torch.')} (expected "
                                           f"{str(expected[n][1]).removeprefix('torch.')})" for n in kinds[:_SHOWN])
                   + (f" and {len(kinds) - _SHOWN} more" if len(kinds) > _SHOWN else ""))
    return out


def check_tensor_set(expected: TensorSet, state: Mapping[str, torch.Tensor], where: str, *,
                     dtypes: bool = True) -> None:
    """Raise unless ``state`` has exactly ``expected``'s names and shapes (and dtypes).

    Raises:
        TensorSetError: ``"<where>: tensor set differs: missing ...; shape of ..."``.
    """
    diff = differences(expected, state, dtypes=dtypes)
    if diff:
        raise TensorSetError(f"{where}: tensor set differs: {'; '.join(diff)}")
