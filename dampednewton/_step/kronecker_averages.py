"""The Kronecker basis' averaged factors: each layer's average and its bias correction.

A layer's stored factors are exponential averages ``F ← βF + (1 − β)F_batch`` that
started at zero, so after ``t`` refreshes their weights sum to ``1 − βᵗ``; the
refresh decomposes the bias-corrected ``F/(1 − βᵗ)``. ``t`` is the layer's own count
(:data:`~._step.kronecker_state.LAYER_REFRESHES`): a layer a refresh did not see
(unused by that step's forward pass) keeps its average and its count, and a layer
that left the group's layers (frozen at a refresh) starts afresh when it returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dampednewton._step.kronecker_state import (
    INPUT_FACTOR,
    LAYER_REFRESHES,
    LAYERS,
    OUTPUT_FACTOR,
    UPDATES,
    holder_index,
)


def layer_refreshes(group: dict[str, Any], stats: Mapping[str, Any]) -> dict[int, int]:
    """The refreshes each layer of the group's statistics holds, by its first parameter.

    Args:
        group: The parameter group.
        stats: Its statistics (:data:`LAYERS`, and :data:`LAYER_REFRESHES` where
            saved; checkpoints of earlier versions count every layer's refreshes as
            the group's).

    Returns:
        ``id(first parameter) → refreshes`` of the layers listed.
    """
    pairs = stats.get(LAYERS, ())
    counts = stats.get(LAYER_REFRESHES, (stats.get(UPDATES, 0),) * len(pairs))
    params = group["params"]
    return {
        id(params[holder_index(pair)]): count
        for pair, count in zip(pairs, counts, strict=True)
    }


def stored_average(
    entry: Mapping[str, Any], mean: tuple[Tensor, Tensor], listed: bool
) -> Mapping[str, Any]:
    """A layer's stored state to average into, or none to start afresh.

    Args:
        entry: The state of the layer's first parameter.
        mean: This refresh's factors ``(A, S)`` of the layer.
        listed: Whether the group's statistics list the layer (else it left them,
            frozen at a refresh, and its stored factors are stale).

    Returns:
        ``entry``, or ``{}`` where the layer is not listed or its factors' shapes
        are not the mean's (a bias frozen or unfrozen).
    """
    if not listed:
        return {}
    inputs, outputs = entry.get(INPUT_FACTOR), entry.get(OUTPUT_FACTOR)
    if inputs is None or outputs is None:
        return entry
    if inputs.shape == mean[0].shape and outputs.shape == mean[1].shape:
        return entry
    return {}


def corrections(decay: float, counts: Sequence[int]) -> float | Tensor:
    """Each layer's bias correction ``1 − β^(t+1)`` after this refresh.

    Args:
        decay: ``β``.
        counts: The refreshes each layer's stored average holds.

    Returns:
        One number where every layer holds as many refreshes (the usual case), else
        a tensor ``[L, 1, 1]`` for stacked factors.
    """
    values = [1 - decay ** (count + 1) for count in counts]
    if len(set(values)) == 1:
        return values[0]
    return torch.tensor(values, dtype=torch.float64).view(-1, 1, 1)


def averaged(
    new: Tensor,
    stored: Sequence[Mapping[str, Any]],
    key: str,
    decay: float,
    correction: float | Tensor,
) -> Tensor:
    """``βF + (1 − β)F_batch`` of stacked factors.

    Where none is stored, ``correction·F_batch``: the bias-corrected average is then
    this refresh's factor (at the first refresh ``correction = 1 − β``, ``F = 0``).
    """
    old = [entry.get(key) for entry in stored]
    present = [factor for factor in old if factor is not None]
    if not present:
        return new * _like(correction, new)
    if len(present) == len(old):
        previous = present[0] if len(present) == 1 else torch.stack(present)
        return torch.lerp(new, previous, decay)
    each = _like(correction, new)
    scales: Sequence[float | Tensor] = (
        each.unbind(0) if isinstance(each, Tensor) else [each] * len(old)
    )
    return torch.stack(
        [
            factor * scale
            if stored_factor is None
            else torch.lerp(factor, stored_factor, decay)
            for factor, stored_factor, scale in zip(
                new.unbind(0), old, scales, strict=True
            )
        ]
    )


def bias_corrected(factor: Tensor, correction: float | Tensor) -> Tensor:
    """``F / (1 − β^(t+1))``, each layer's by its own correction."""
    if isinstance(correction, float) and correction == 1:
        return factor
    return factor / _like(correction, factor)


def _like(correction: float | Tensor, factor: Tensor) -> Tensor | float:
    """The correction as a number, or per layer in ``factor``'s dtype and device."""
    if isinstance(correction, Tensor):
        return correction.to(factor.dtype).to(factor.device)
    return correction
