"""The batch's buffers of a layer from the buffers of its micro-batches.

A closure that accumulates gradients back-propagates, for each micro-batch ``m`` of
``N_m`` samples, its mean loss ``L_m`` times a weight ``w_m`` (``N_m/N``, or ``1/M``
for ``M`` micro-batches): ``.grad`` is the gradient of ``L = Σ_m w_m L_m``, the mean
over the ``N = Σ_m N_m`` samples of the per-sample losses ``N (w_m/N_m) ℓ_n``. With
``w_m = N_m/N`` (for equal sizes: ``1/M``) that is the batch's mean loss.

BackPACK's buffers of micro-batch ``m`` describe ``L_m``: square roots carry
``1/√N_m`` but not ``w_m`` (BackPACK starts them at the loss), individual and output
gradients carry ``w_m/N_m`` (they are the gradients that reached the layer). The
square roots of ``L`` in BackPACK's convention for ``N`` samples are
``√(w_m) · 1/√N_m`` times the micro-batch's, gradients are unchanged: concatenated
along the samples, these are the buffers of one backward pass over the batch with
the per-sample losses above, which the single-batch assembly then reduces unchanged
(batch size ``N``). The square roots are scaled by ``√(w_m/W)`` with ``W = Σ_m w_m``:
for ``W = 1`` this is the above; otherwise the curvature is that of ``L/W`` while
``.grad`` is ``L``'s, as for a single loss back-propagated times ``W`` (the step
warns about both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from dampednewton.backpack.buffers import Buffers, SharedLinearBuffers
from dampednewton.backpack.global_batch import Stored

Join = Callable[[Sequence[Tensor], int, bool], Tensor]
"""Concatenates the micro-batches' tensors along a dimension, scaled or not."""


@dataclass(frozen=True)
class MicroBatch:
    """What the engine kept of one micro-batch's backward pass.

    Attributes:
        batch_size: Its number of samples ``N_m``.
        weight: The gradient that reached its loss, ``w_m`` (0-dim); ``None``: 1.
        layers: Per layer reached (in backward order), the parameters' stored
            buffers, keyed by the parameters' identities.
    """

    batch_size: int
    weight: Tensor | None
    layers: dict[tuple[int, ...], list[Stored]]


def square_root_scales(micro_batches: Sequence[MicroBatch]) -> list[Tensor]:
    """The factors ``√(w_m/W)`` of the micro-batches' square roots.

    Args:
        micro_batches: The closure's micro-batches, in order.

    Returns:
        One 0-dim tensor per micro-batch.
    """
    weights = [
        torch.ones((), dtype=torch.float64) if m.weight is None else m.weight
        for m in micro_batches
    ]
    device = weights[-1].device
    stacked = torch.stack([w.to(device=device, dtype=torch.float64) for w in weights])
    return list((stacked / stacked.sum()).sqrt().unbind())


def concatenated_layer(
    parts: Sequence[Sequence[Stored]], scales: Sequence[Tensor]
) -> list[Stored]:
    """One layer's buffers of the concatenated batch.

    Tensors that the parameters of the layer share (a weight's and its bias's
    back-propagated square root, inputs that are also the whole batch's inputs)
    are concatenated once, so they stay shared.

    Args:
        parts: Per micro-batch, the stored buffers of the layer's parameters (same
            parameters, same order).
        scales: Per micro-batch, its square roots' factor
            (:func:`square_root_scales`).

    Returns:
        The concatenated buffers, per parameter.
    """
    memo: dict[tuple[int, bool], Tensor] = {}

    def joined(tensors: Sequence[Tensor], dim: int, scaled: bool) -> Tensor:
        key = (id(tensors[0]), scaled)
        if key not in memo:
            pieces = [
                t * s.to(dtype=t.dtype) if scaled else t
                for t, s in zip(tensors, scales, strict=True)
            ]
            memo[key] = torch.cat([p.detach() for p in pieces], dim=dim)
        return memo[key]

    with torch.no_grad():
        return [
            _joined_entry([part[index] for part in parts], joined)
            for index in range(len(parts[0]))
        ]


def _joined_entry(entries: Sequence[Stored], joined: Join) -> Stored:
    """One parameter's concatenated square root and individual gradients."""
    gradients = _all_present([e.grad_batch for e in entries])
    grad_batch = None if gradients is None else joined(gradients, 0, False)
    roots = [e.sqrt_ggn for e in entries]
    tensors = [root for root in roots if isinstance(root, Tensor)]
    if len(tensors) == len(roots):
        return Stored(joined(tensors, 1, True), grad_batch)
    buffers = [root for root in roots if not isinstance(root, Tensor)]
    return Stored(_joined_buffers(buffers, joined), grad_batch)


def _joined_buffers(buffers: Sequence[Buffers], joined: Join) -> Buffers:
    """Concatenated structured buffers: square roots scaled, the rest unchanged."""

    def unscaled(values: Sequence[Tensor | None]) -> Tensor | None:
        present = _all_present(values)
        return None if present is None else joined(present, 0, False)

    backproped = joined([b.backproped for b in buffers], 1, True)
    output_gradients = joined([b.output_gradients for b in buffers], 0, False)
    inputs = unscaled([b.inputs for b in buffers])
    layer_inputs = unscaled([b.layer_inputs for b in buffers])
    first = buffers[0]
    if isinstance(first, SharedLinearBuffers):
        assert inputs is not None and layer_inputs is not None
        return replace(
            first,
            backproped=backproped,
            inputs=inputs,
            output_gradients=output_gradients,
            layer_inputs=layer_inputs,
        )
    return replace(
        first,
        backproped=backproped,
        inputs=inputs,
        output_gradients=output_gradients,
        layer_inputs=layer_inputs,
    )


def _all_present(values: Sequence[Tensor | None]) -> list[Tensor] | None:
    """The tensors, or ``None`` if one of them is ``None``."""
    present = [value for value in values if value is not None]
    return present if len(present) == len(values) else None
