"""A cost model of data-parallel DampedNewton: bytes, link time, Gram matrix growth.

A model on paper, not a measurement (``benchmarks.scaling.scaling`` measures on
CPU/gloo).
Per step, each of ``R`` ranks with ``n`` local samples:

* **DampedNewton's gathers** (:func:`dampednewton_bytes`): every layer's BackPACK
  buffers are all-gathered along the samples, so a rank receives the other ranks'
  ``(R − 1)·n`` samples of ``b`` bytes each (:func:`gathered_layout` computes ``b``
  from the model's shapes the way the engine stores them), plus the agreement on the
  pass (three float64 numbers per rank), the refusal flags (one float64 per rank,
  all-reduced) and, on Levenberg-Marquardt damping's adaptation steps, the mean loss
  after the step (one all-reduced float64). This grows with ``R`` without bound.
* **The Kronecker basis' factors** (:func:`kronecker_bytes`): on a refresh, one ring
  all-reduce of every layer's two factors (``(d_in + 1)² + d_out²`` numbers per layer,
  :func:`kronecker_numbers`), the agreement and the refusal flag; between refreshes
  the agreement and the flag only. Independent of the batch and of ``R``'s growth
  beyond the ring's ``2 (R − 1)/R``.
* **DDP's gradient all-reduce** (:func:`all_reduce_bytes`): a ring all-reduce of the
  ``P`` parameters' gradients receives ``2 (R − 1) / R · 4 P`` bytes in float32,
  bounded by ``8 P``; DampedNewton reuses it for the mean gradient.
* **Time** (α–β model, :func:`all_gather_seconds`, :func:`all_reduce_seconds`): a
  ring collective costs ``(R − 1)·α`` (all-gather) or ``2 (R − 1)·α`` (all-reduce)
  of latency plus bytes received over the link bandwidth ``β``; links are
  :data:`NVLINK` and :data:`INFINIBAND` classes. Overlap with compute, contention
  and DDP's bucketing overlap with the backward pass are ignored.
* **Gram matrix** (:func:`gram_growth`): ``m = R·n·C`` columns (``C`` = Monte-Carlo
  samples or classes), ``m²`` entries formed at ``~gram_macs_per_entry`` multiply-adds
  each, and a full eigendecomposition of ``~9 m³`` flops (symmetric QR with
  eigenvectors, Golub & Van Loan); every rank repeats both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dampednewton.math.cost import prefers_structured
from dampednewton.math.traffic import (
    LinearLayerShapes,
    Route,
    cheaper_route,
    gathered_numbers,
)

FLOAT32_BYTES = 4
AGREEMENT_BYTES = 3 * 8
"""Per rank and pass: loss, batch size and status, all-gathered as float64."""
REFUSAL_BYTES = 8
"""The refusal flags, all-reduced as one float64 per rank (the refusing ranks)."""
LOSS_AFTER_STEP_BYTES = 8
"""Levenberg-Marquardt's mean loss after the step, one float64."""
FIXED_COLLECTIVES = 2
"""The agreement's all-gather and the refusal flag's all-reduce."""
EIGH_FLOPS_PER_CUBE = 9.0
"""Flops of a dense symmetric eigendecomposition with eigenvectors, per ``m³``."""
DDP_BUCKET_BYTES = 25 * 2**20
"""DistributedDataParallel's default gradient bucket (``bucket_cap_mb=25``)."""


@dataclass(frozen=True)
class Link:
    """An interconnect in the α–β model.

    Attributes:
        name: What it stands for.
        bandwidth: Bytes per second one rank receives (``β``).
        latency: Seconds per message hop (``α``).
    """

    name: str
    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        """Check the numbers.

        Raises:
            ValueError: Unless bandwidth and latency are positive.
        """
        if self.bandwidth <= 0 or self.latency <= 0:
            raise ValueError(
                f"Link {self.name!r} needs a positive bandwidth and latency, got "
                f"{self.bandwidth} B/s and {self.latency} s."
            )


NVLINK = Link("NVLink-class (450 GB/s, 5 µs)", 450e9, 5e-6)
INFINIBAND = Link("InfiniBand-class (25 GB/s, 10 µs)", 25e9, 10e-6)


@dataclass(frozen=True)
class GatheredLayout:
    """What the engine all-gathers per sample, and the model's sizes.

    Attributes:
        floats_per_sample: Numbers gathered per sample and step.
        tensors: All-gathers per step for the buffers (one per distinct tensor).
        gram_macs_per_entry: Multiply-adds per Gram matrix entry, summed over layers.
        forward_macs_per_sample: Multiply-adds of one sample's forward pass.
        num_parameters: ``P``.
    """

    floats_per_sample: int
    tensors: int
    gram_macs_per_entry: int
    forward_macs_per_sample: int
    num_parameters: int


def gathered_layout(
    model: nn.Module, input_shape: Sequence[int], columns: int, local_batch: int
) -> GatheredLayout:
    """What DampedNewton all-gathers for ``model``, from its shapes.

    Per linear layer or convolution, the engine's own rule
    (:func:`~dampednewton.math.traffic.cheaper_route`): the structured buffers
    (back-propagated square root, output gradients, inputs; unfolded and per
    position for shared weights) or the square root ``V`` materialized from them,
    whichever moves fewer bytes. The Gram matrix's multiply-adds per entry follow
    :func:`~dampednewton.math.cost.prefers_structured` for the local batch. Layers
    without parameters gather nothing.

    Args:
        model: The model (Linear and Conv layers carry the parameters).
        input_shape: One sample's input shape.
        columns: ``C``, square-root columns per sample (Monte-Carlo samples, or
            classes for the exact GGN).
        local_batch: ``n``, samples per rank (the structured-or-dense choice
            depends on it).

    Returns:
        The layout.
    """
    shapes: dict[nn.Module, tuple[int, ...]] = {}
    hooks = [
        module.register_forward_hook(
            lambda module, _, output: shapes.__setitem__(module, tuple(output.shape))
        )
        for module in model.modules()
        if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d)
    ]
    try:
        with torch.no_grad():
            model(torch.zeros(1, *input_shape))
    finally:
        for hook in hooks:
            hook.remove()
    floats = tensors = gram = forward = 0
    for module, shape in shapes.items():
        weight: Tensor = module.weight  # type: ignore[assignment]  # Linear or Conv
        d_out, d_in = weight.shape[0], weight[0].numel()
        plain = isinstance(module, nn.Linear) and len(shape) == 2
        if isinstance(module, nn.Linear):
            positions = math.prod(shape[1:-1])
        else:
            positions = math.prod(shape[2:])
        forward += positions * weight.numel()
        has_bias = getattr(module, "bias", None) is not None
        layer = LinearLayerShapes(
            num_outputs=columns,
            num_samples=local_batch,
            gradient_samples=local_batch,
            positions=None if plain else positions,
            in_features=d_in,
            out_features=d_out,
            bias=has_bias,
        )
        route = cheaper_route(layer)
        numbers = gathered_numbers(layer)[route]
        floats += numbers // local_batch  # every term is linear in the samples
        bias_tensors = 2 if has_bias and (route is Route.SQRT_GGN or not plain) else 0
        tensors += (3 if route is Route.FACTORS else 1) + bias_tensors
        if plain:
            gram += d_out + d_in
        elif prefers_structured(columns, local_batch, positions, d_in, d_out):
            gram += positions**2 * (d_out + 1 + d_in)
        else:
            gram += weight.numel()
        if has_bias and not plain:
            gram += d_out
    return GatheredLayout(
        floats_per_sample=floats,
        tensors=tensors,
        gram_macs_per_entry=gram,
        forward_macs_per_sample=forward,
        num_parameters=sum(p.numel() for p in model.parameters()),
    )


def dampednewton_bytes(
    bytes_per_sample: float,
    world_size: int,
    local_batch: int,
    *,
    reduction_ratio: bool = False,
) -> float:
    """Bytes one rank receives per step in DampedNewton's collectives.

    Args:
        bytes_per_sample: ``b``, bytes gathered per sample (``floats_per_sample``
            times the element size).
        world_size: ``R``.
        local_batch: ``n``.
        reduction_ratio: Whether the damping needs the mean loss after the step
            (Levenberg-Marquardt, on its adaptation steps).

    Returns:
        ``(R − 1)·(n·b + agreement) + 2 (R − 1)/R · (R·flag + loss)``; 0 for one
        rank.
    """
    gathered = (world_size - 1) * (local_batch * bytes_per_sample + AGREEMENT_BYTES)
    flags = REFUSAL_BYTES * world_size
    reduced = flags + (LOSS_AFTER_STEP_BYTES if reduction_ratio else 0)
    return gathered + all_reduce_bytes(world_size, reduced)


def kronecker_numbers(model: nn.Module) -> int:
    """Numbers of the Kronecker factors a refresh all-reduces for ``model``.

    Per ``nn.Linear`` or convolution with weight ``[d_out, c_in, *k]``: the input
    factor ``((c_in·Πk) + 1)²`` (``+ 1`` with a bias), the output factor ``d_out²``
    and the micro-batch weight's sum.

    Args:
        model: The model (every parameter in such a layer).

    Returns:
        The count.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d):
            inputs = module.weight[0].numel() + (module.bias is not None)
            count += inputs**2 + module.weight.shape[0] ** 2 + 1
    return count


def kronecker_bytes(
    factor_bytes: float, world_size: int, *, refresh: bool = True
) -> float:
    """Bytes one rank receives per step of the Kronecker basis.

    Args:
        factor_bytes: The factors' bytes (:func:`kronecker_numbers` times the
            element size).
        world_size: ``R``.
        refresh: A refresh step (factors all-reduced) or a step between refreshes.

    Returns:
        ``(R − 1)·agreement + 2 (R − 1)/R · (R·flag + factors)``; 0 for one rank.
    """
    reduced = REFUSAL_BYTES * world_size + (factor_bytes if refresh else 0.0)
    return (world_size - 1) * AGREEMENT_BYTES + all_reduce_bytes(world_size, reduced)


def all_reduce_bytes(world_size: int, num_bytes: float) -> float:
    """Bytes one rank receives in a ring all-reduce of ``num_bytes``.

    Args:
        world_size: ``R``.
        num_bytes: Size of the reduced tensor(s).

    Returns:
        ``2 (R − 1) / R · num_bytes``.
    """
    return 2 * (world_size - 1) / world_size * num_bytes


def ddp_buckets(num_parameters: int, element_size: int = FLOAT32_BYTES) -> int:
    """All-reduces per step of DDP's gradient buckets (default bucket size)."""
    return math.ceil(num_parameters * element_size / DDP_BUCKET_BYTES)


def all_gather_seconds(
    bytes_received: float, collectives: int, world_size: int, link: Link
) -> float:
    """α–β time of ring all-gathers: ``collectives·(R − 1)·α + bytes/β``."""
    latency = collectives * (world_size - 1) * link.latency
    return latency + bytes_received / link.bandwidth


def all_reduce_seconds(
    bytes_received: float, collectives: int, world_size: int, link: Link
) -> float:
    """α–β time of ring all-reduces: ``collectives·2 (R − 1)·α + bytes/β``."""
    latency = collectives * 2 * (world_size - 1) * link.latency
    return latency + bytes_received / link.bandwidth


@dataclass(frozen=True)
class GramGrowth:
    """Size and cost of the global Gram matrix on every rank.

    Attributes:
        size: ``m = R·n·C``.
        entries: ``m²``.
        formation_flops: ``2 m²`` times the multiply-adds per entry.
        eigh_flops: ``9 m³`` (full eigendecomposition).
        local_backward_flops: Forward and backward of the local batch, ``3 × 2 n``
            times the forward multiply-adds, for comparison.
    """

    size: int
    entries: int
    formation_flops: float
    eigh_flops: float
    local_backward_flops: float


def gram_growth(
    layout: GatheredLayout, world_size: int, local_batch: int, columns: int
) -> GramGrowth:
    """How the Gram matrix grows with the number of ranks.

    Args:
        layout: The model's layout (:func:`gathered_layout`).
        world_size: ``R``.
        local_batch: ``n``.
        columns: ``C``.

    Returns:
        The Gram matrix's size and flops, next to the local backward pass's.
    """
    size = world_size * local_batch * columns
    return GramGrowth(
        size=size,
        entries=size**2,
        formation_flops=2.0 * size**2 * layout.gram_macs_per_entry,
        eigh_flops=EIGH_FLOPS_PER_CUBE * size**3,
        local_backward_flops=6.0 * local_batch * layout.forward_macs_per_sample,
    )
