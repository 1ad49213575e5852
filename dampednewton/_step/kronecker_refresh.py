"""The Kronecker basis' refresh: new averaged factors, their eigenpairs, the commit.

A refresh pass's hook (:class:`~dampednewton.backpack.kronecker_hook.FactorCollector`)
leaves each layer's factors of the batch; :func:`refreshed_layers` averages them into
the stored ones and decomposes them (uncommitted, :class:`RefreshedBatch`);
:func:`commit_layers` stores them with an accepted step. Layers of one shape (weight,
bias, factor dimensions, dtype, device) are refreshed together: their factors are
stacked once, and the averages, eigensolvers and Rayleigh quotients run batched, so
the refresh's operators grow with the distinct layer shapes, not with the layers; a
rotating refresh then solves every layer's eigenproblems of one size in one batched
``eigh`` (:mod:`._step.kronecker_decomposition`).
The stacked eigenpairs are the :class:`~._step.kronecker_group.LayerBatch` the steps
until the next refresh use. Under data parallelism :func:`mean_over_ranks` averages
the batch's factors over the ranks first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dampednewton._step.kronecker_averages import (
    averaged,
    bias_corrected,
    corrections,
    layer_refreshes,
    stored_average,
)
from dampednewton._step.kronecker_decomposition import Decomposed, decomposed
from dampednewton._step.kronecker_group import LayerBatch
from dampednewton._step.kronecker_state import (
    INPUT_EIGEN,
    INPUT_FACTOR,
    LAYER_REFRESHES,
    LAYERS,
    OUTPUT_EIGEN,
    OUTPUT_FACTOR,
    UPDATES,
    LayerBasis,
    eigen_entries,
    holder_index,
)
from dampednewton._step.options import GroupOptions
from dampednewton.backpack.kronecker_hook import LayerFactors
from dampednewton.distributed import Communicator
from dampednewton.math.kronecker import unstacked_eigen
from dampednewton.math.kronecker_factors import FactorEigen, FactorEigenBatch
from dampednewton.math.kronecker_rotation import RotationBatch
from dampednewton.policies.basis import KroneckerBasis

COMPILE_HINT = (
    "A torch.compile'd model can skip BackPACK's hooks (TorchDynamo reuses graphs "
    "compiled for a plain model of the same class and does not guard on hooks), and "
    "gains nothing from compilation here: step with the uncompiled model."
)


@dataclass(frozen=True)
class RefreshedBatch:
    """Layers of one shape with their new (uncommitted) averages and eigenpairs.

    Attributes:
        batch: The layers and their eigenpairs (stacked for several layers).
        inputs: The new averaged ``A`` factors ``[(L,) d_in (+1), d_in (+1)]``.
        outputs: The new averaged ``S`` factors ``[(L,) d_out, d_out]``.
        refreshes: The refreshes each layer's new average holds.
    """

    batch: LayerBatch
    inputs: Tensor
    outputs: Tensor
    refreshes: tuple[int, ...]


def refreshed_layers(
    group: dict[str, Any],
    option: GroupOptions,
    stats: dict[str, Any],
    state: Any,
    factors: dict[int, LayerFactors],
) -> list[RefreshedBatch]:
    """The group's layers with their updated averages and bases, batched by shape.

    Raises:
        RuntimeError: For a trainable parameter with a gradient that no curvature
            reached.
        ValueError: For a layer split between groups.
    """
    basis_policy = option.basis
    assert isinstance(basis_policy, KroneckerBasis)
    decay = 0.0 if option.averaging is None else option.averaging.decay
    shapes: dict[tuple, list[LayerFactors]] = {}
    covered: set[int] = set()
    _check_whole_layers(group, factors)
    for param in group["params"]:
        layer = factors.get(id(param))
        if layer is None:
            continue
        covered.update(id(p) for p in (layer.weight, layer.bias) if p is not None)
        shapes.setdefault(_shape_key(layer), []).append(layer)
    for param in group["params"]:
        # A parameter this step's forward pass did not use has no gradient either
        # (or zeros, after zero_grad(set_to_none=False)): it keeps its factors.
        if not param.requires_grad or id(param) in covered or param.grad is None:
            continue
        if param.grad.any():  # a host read, on this path only
            raise RuntimeError(
                "No curvature reached a parameter of shape "
                f"{tuple(param.shape)}: extend model and loss function with BackPACK "
                "(`model = backpack.extend(model)`, `loss_fn = backpack.extend("
                "loss_fn)`), call `loss.backward()` in the closure and use every "
                "parameter in the forward pass. " + COMPILE_HINT
            )
    counts = layer_refreshes(group, stats)
    # Without averaging the factors are this batch's: every refresh decomposes them.
    updates = stats.get(UPDATES, 0)
    rotate = decay == 0 or basis_policy.rotates(updates)
    # Without averaging each refresh's factors are new: they are solved afresh.
    solve = decay == 0 or basis_policy.solves(updates)
    batches = [
        _averaged_batch(members, state, decay, counts) for members in shapes.values()
    ]
    # Every layer's eigenproblems are queued first, then solved in one batched
    # eigh per size (on a GPU one synchronization each, not one per factor); the
    # rotations likewise (on a GPU one padded QR of every factor).
    eigen_batch, rotations = FactorEigenBatch(), RotationBatch()
    decompositions = [
        batch.decomposition(basis_policy, rotate, solve, eigen_batch, rotations)
        for batch in batches
    ]
    solved, rotated = eigen_batch.solve(), rotations.solve()
    return [
        _with_eigenpairs(batch, decomposition.eigenpairs(solved, rotated))
        for batch, decomposition in zip(batches, decompositions, strict=True)
    ]


def _check_whole_layers(
    group: dict[str, Any], factors: dict[int, LayerFactors]
) -> None:
    """Refuse a layer whose weight and bias are in different groups.

    Raises:
        ValueError: If one of the group's parameters shares its layer with a
            parameter of another group.
    """
    members = {id(p) for p in group["params"]}
    for layer in factors.values():
        pair = [p for p in (layer.weight, layer.bias) if p is not None]
        if len({id(p) in members for p in pair}) > 1:
            raise ValueError(
                "A layer's weight and bias are in different parameter groups: the "
                "Kronecker basis steps each layer as one block (its bias is a "
                "column of the input factor). Put them in one group, or use "
                "GramBasis() for groups that split layers."
            )


def _shape_key(layer: LayerFactors) -> tuple:
    """What layers must share to be refreshed (and then stepped) together."""
    return (
        None if layer.weight is None else tuple(layer.weight.shape),
        None if layer.bias is None else tuple(layer.bias.shape),
        tuple(layer.inputs.shape),
        tuple(layer.outputs.shape),
        layer.inputs.dtype,
        layer.inputs.device,
    )


@dataclass(frozen=True)
class _AveragedBatch:
    """Layers of one shape with their new averaged factors (not yet decomposed)."""

    members: list[LayerFactors]
    stored: list[Mapping[str, Any]]
    inputs: Tensor
    outputs: Tensor
    held: list[int]
    correction: Tensor | float

    def decomposition(
        self,
        basis: KroneckerBasis,
        rotate: bool,
        solve: bool,
        eigen_batch: FactorEigenBatch,
        rotations: RotationBatch,
    ) -> Decomposed:
        """Queue the eigenpairs of the bias-corrected averages.

        They are the averages' own eigenvectors (one division per factor).
        """
        return decomposed(
            basis,
            self.stored,
            bias_corrected(self.inputs, self.correction),
            bias_corrected(self.outputs, self.correction),
            rotate,
            eigen_batch,
            rotations,
            solve,
        )


def _averaged_batch(
    members: list[LayerFactors],
    state: Any,
    decay: float,
    counts: Mapping[int, int],
) -> _AveragedBatch:
    """Average the factors of layers of one shape together.

    A layer without stored factors (new to the group, frozen at a refresh since, or
    whose factors changed shape: a bias frozen or unfrozen) starts its average at
    this refresh's factors (:func:`~._step.kronecker_averages.stored_average`).
    """
    means = [layer.mean() for layer in members]
    firsts = [id(layer.first) for layer in members]
    stored = [
        stored_average(state[layer.first], mean, first in counts)
        for layer, mean, first in zip(members, means, firsts, strict=True)
    ]
    held = [
        counts.get(first, 0) if entry else 0
        for first, entry in zip(firsts, stored, strict=True)
    ]
    if len(members) == 1:
        inputs, outputs = means[0]
    else:
        inputs = torch.stack([mean[0] for mean in means])
        outputs = torch.stack([mean[1] for mean in means])
    correction = corrections(decay, held)
    if decay > 0:
        inputs = averaged(inputs, stored, INPUT_FACTOR, decay, correction)
        outputs = averaged(outputs, stored, OUTPUT_FACTOR, decay, correction)
    return _AveragedBatch(members, stored, inputs, outputs, held, correction)


def _with_eigenpairs(
    batch: _AveragedBatch, eigenpairs: tuple[FactorEigen, FactorEigen]
) -> RefreshedBatch:
    """The averaged layers with their eigenpairs ``(S, A)`` (stacked for several)."""
    output_eigen, input_eigen = eigenpairs
    if len(batch.members) == 1:
        each = [(output_eigen, input_eigen)]
    else:
        each = list(
            zip(
                unstacked_eigen(output_eigen), unstacked_eigen(input_eigen), strict=True
            )
        )
    layers = [
        LayerBasis(layer.weight, layer.bias, output, input_side)
        for layer, (output, input_side) in zip(batch.members, each, strict=True)
    ]
    return RefreshedBatch(
        LayerBatch(layers, output_eigen, input_eigen),
        batch.inputs,
        batch.outputs,
        tuple(count + 1 for count in batch.held),
    )


def commit_layers(
    refreshed: Sequence[RefreshedBatch],
    group: dict[str, Any],
    stats: dict[str, Any],
    state: Any,
) -> list[LayerBatch] | None:
    """Store a group's refreshed layers; return their batches.

    The layers this step's forward pass did not use keep their stored bases: then
    ``None``, the batches are to be read from the state
    (:func:`~dampednewton._step.kronecker_state.stored_bases`).
    """
    position = {id(p): i for i, p in enumerate(group["params"])}
    counts = layer_refreshes(group, stats)
    pairs = []
    held = []
    for entry in refreshed:
        batch = entry.batch
        stacked = batch.stacked
        inputs = entry.inputs.unbind(0) if stacked else (entry.inputs,)
        outputs = entry.outputs.unbind(0) if stacked else (entry.outputs,)
        for basis, input_factor, output_factor, count in zip(
            batch.layers, inputs, outputs, entry.refreshes, strict=True
        ):
            state[basis.first].update(
                {
                    INPUT_FACTOR: input_factor,
                    OUTPUT_FACTOR: output_factor,
                    **eigen_entries(INPUT_EIGEN, basis.inputs),
                    **eigen_entries(OUTPUT_EIGEN, basis.output),
                }
            )
            pairs.append(
                (
                    None if basis.weight is None else position[id(basis.weight)],
                    None if basis.bias is None else position[id(basis.bias)],
                )
            )
            held.append(count)
    # A layer this step's forward pass did not use keeps its basis for the next steps.
    params = group["params"]
    refreshed_positions = {i for pair in pairs for i in pair if i is not None}
    kept = [
        pair
        for pair in stats.get(LAYERS, ())
        if refreshed_positions.isdisjoint(i for i in pair if i is not None)
        # unused (refreshed_layers refused a trainable one with a gradient)
        and all(params[i].requires_grad for i in pair if i is not None)
    ]
    pairs += kept
    held += [counts[id(params[holder_index(pair)])] for pair in kept]
    # In the group's order of the parameters that hold each layer's state.
    ordered = sorted(
        zip(pairs, held, strict=True), key=lambda item: holder_index(item[0])
    )
    stats[LAYERS] = tuple(pair for pair, _ in ordered)
    stats[LAYER_REFRESHES] = tuple(count for _, count in ordered)
    stats[UPDATES] = stats.get(UPDATES, 0) + 1
    stats["num_directions"] = sum(
        basis.output.values.numel() * basis.inputs.values.numel()
        for entry in refreshed
        for basis in entry.batch.layers
    )
    return None if kept else [entry.batch for entry in refreshed]


def mean_over_ranks(
    factors: dict[int, LayerFactors], communicator: Communicator
) -> None:
    """Average every layer's factor sums over the ranks in one all-reduce."""
    layers = list(factors.values())
    if not layers:  # nothing reached the hook (not extended): refused after
        return
    totals = torch.stack([layer.weigh() for layer in layers])
    flat = torch.cat(
        [t.reshape(-1) for layer in layers for t in (layer.inputs, layer.outputs)]
        + [totals]
    )
    summed = communicator.sum_over_ranks(flat)
    offset = 0
    for layer in layers:
        for name in ("inputs", "outputs"):
            tensor = getattr(layer, name)
            size = tensor.numel()
            setattr(layer, name, summed[offset : offset + size].view_as(tensor))
            offset += size
    for layer, total in zip(layers, summed[offset:], strict=True):
        layer.total = total


def factors_finite(refreshed: Sequence[RefreshedBatch]) -> Tensor | None:
    """Whether every new averaged factor is finite (0-dim, read with the step's checks).

    The averages carry a non-finite factor of the batch on; one sum per stack of
    layers. ``None`` without factors.
    """
    if not refreshed:
        return None
    sums = [entry.inputs.sum() + entry.outputs.sum() for entry in refreshed]
    return torch.isfinite(torch.stack(sums)).all()
