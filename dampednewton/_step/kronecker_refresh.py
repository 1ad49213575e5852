"""The Kronecker basis' refresh: new averaged factors, their eigenpairs, the commit.

A refresh pass's hook (:class:`~dampednewton.backpack.kronecker_hook.FactorCollector`)
leaves each layer's factors of the batch; :func:`refreshed_layers` averages them into
the stored ones and decomposes them (uncommitted, :class:`Refreshed`);
:func:`commit_layers` stores them with an accepted step. Under data parallelism
:func:`mean_over_ranks` averages the batch's factors over the ranks first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dampednewton._step.kronecker_state import (
    INPUT_EIGEN,
    INPUT_FACTOR,
    LAYERS,
    OUTPUT_EIGEN,
    OUTPUT_FACTOR,
    UPDATES,
    LayerBasis,
    eigen_entries,
    stored_eigen,
)
from dampednewton._step.options import GroupOptions
from dampednewton.backpack.kronecker_hook import LayerFactors
from dampednewton.distributed import Communicator
from dampednewton.math.kronecker_factors import (
    FactorEigen,
    factor_eigen,
    refreshed_values,
)
from dampednewton.policies.basis import KroneckerBasis

COMPILE_HINT = (
    "A torch.compile'd model can skip BackPACK's hooks (TorchDynamo reuses graphs "
    "compiled for a plain model of the same class and does not guard on hooks), and "
    "gains nothing from compilation here: step with the uncompiled model."
)


@dataclass(frozen=True)
class Refreshed:
    """A layer's new (uncommitted) averages and the basis decomposed from them."""

    basis: LayerBasis
    inputs: Tensor
    outputs: Tensor


def refreshed_layers(
    group: dict[str, Any],
    option: GroupOptions,
    stats: dict[str, Any],
    state: Any,
    factors: dict[int, LayerFactors],
) -> list[Refreshed]:
    """The group's layers with their updated averages and bases.

    Raises:
        RuntimeError: For a trainable parameter that no curvature reached.
    """
    basis_policy = option.basis
    assert isinstance(basis_policy, KroneckerBasis)
    decay = 0.0 if option.averaging is None else option.averaging.decay
    correction = 1 - decay ** (stats.get(UPDATES, 0) + 1)
    layers = []
    covered: set[int] = set()
    for param in group["params"]:
        layer = factors.get(id(param))
        if layer is None:
            continue
        covered.update(id(p) for p in (layer.weight, layer.bias) if p is not None)
        stored = state[param]
        inputs, outputs = layer.mean()
        if decay > 0 and INPUT_FACTOR in stored:
            inputs = torch.lerp(inputs, stored[INPUT_FACTOR], decay)
            outputs = torch.lerp(outputs, stored[OUTPUT_FACTOR], decay)
        elif decay > 0:
            inputs, outputs = (1 - decay) * inputs, (1 - decay) * outputs
        output_eigen, input_eigen = decomposed(
            basis_policy, stored, inputs, outputs, stats.get(UPDATES, 0)
        )
        basis = LayerBasis(
            layer.weight,
            layer.bias,
            output_eigen.scaled(1 / correction),
            input_eigen.scaled(1 / correction),
        )
        layers.append(Refreshed(basis, inputs, outputs))
    for param in group["params"]:
        if param.requires_grad and id(param) not in covered:
            raise RuntimeError(
                "No curvature reached a parameter of shape "
                f"{tuple(param.shape)}: extend model and loss function with BackPACK "
                "(`model = backpack.extend(model)`, `loss_fn = backpack.extend("
                "loss_fn)`), call `loss.backward()` in the closure and use every "
                "parameter in the forward pass. " + COMPILE_HINT
            )
    return layers


def decomposed(
    basis: KroneckerBasis,
    stored: dict[str, Any],
    inputs: Tensor,
    outputs: Tensor,
    refreshes: int,
) -> tuple[FactorEigen, FactorEigen]:
    """Eigenpairs of a layer's averaged factors ``(S, A)`` for this refresh.

    Rotating refreshes (:meth:`KroneckerBasis.rotates`) decompose the factors anew;
    the others refresh the eigenvalues along the stored eigenvectors.
    """
    output = stored_eigen(stored, OUTPUT_EIGEN)
    input_eigen = stored_eigen(stored, INPUT_EIGEN)
    if output is None or input_eigen is None or basis.rotates(refreshes):
        return (
            factor_eigen(
                outputs,
                basis.kept(outputs.shape[0]),
                None if output is None else output.vectors,
            ),
            factor_eigen(
                inputs,
                basis.kept(inputs.shape[0]),
                None if input_eigen is None else input_eigen.vectors,
            ),
        )
    return refreshed_values(outputs, output), refreshed_values(inputs, input_eigen)


def commit_layers(
    layers: Sequence[Refreshed],
    group: dict[str, Any],
    stats: dict[str, Any],
    state: Any,
) -> list[LayerBasis]:
    """Store a group's refreshed layers; return their bases."""
    position = {id(p): i for i, p in enumerate(group["params"])}
    pairs = []
    for layer in layers:
        basis = layer.basis
        state[basis.first].update(
            {
                INPUT_FACTOR: layer.inputs,
                OUTPUT_FACTOR: layer.outputs,
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
    stats[LAYERS] = tuple(pairs)
    stats[UPDATES] = stats.get(UPDATES, 0) + 1
    stats["num_directions"] = sum(
        layer.basis.output.values.numel() * layer.basis.inputs.values.numel()
        for layer in layers
    )
    return [layer.basis for layer in layers]


def mean_over_ranks(
    factors: dict[int, LayerFactors], communicator: Communicator
) -> None:
    """Average every layer's factor sums over the ranks in one all-reduce."""
    layers = list(factors.values())
    if not layers:  # nothing reached the hook (not extended): refused after
        return
    flat = torch.cat(
        [t.reshape(-1) for layer in layers for t in (layer.inputs, layer.outputs)]
        + [torch.stack([layer.total for layer in layers])]
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


def factors_finite(factors: dict[int, LayerFactors]) -> Tensor | None:
    """Whether every factor is finite (0-dim, read with the step's checks).

    ``None`` without factors.
    """
    if not factors:
        return None
    sums = [layer.inputs.sum() + layer.outputs.sum() for layer in factors.values()]
    return torch.isfinite(torch.stack(sums)).all()
