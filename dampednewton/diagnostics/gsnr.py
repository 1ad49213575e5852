r"""Gradient signal-to-noise ratio (GSNR) and gradient noise scale estimators.

Pure tensor functions, no state. Notation for one parameter element ``j`` and a
mini-batch of ``N`` samples with a mean loss ``L = (1/N) Σ_n ℓ_n``:

* ``g_n = ∇ℓ_n`` the per-sample gradients, ``ḡ = (1/N) Σ_n g_n`` the mini-batch
  gradient (``p.grad``);
* ``V = (1/N) Σ_n (g_n − ḡ)²`` their (biased, ``1/N``) variance and
  ``S² = N·V/(N − 1)`` the unbiased one;
* ``μ = E[g_n]`` and ``σ² = Var[g_n]`` the true mean and variance.

BackPACK with a mean loss stores ``grad_batch = g_n/N`` and
``sum_grad_squared = Σ_n (g_n/N)²``, so ``(1/N) Σ_n g_n² = N·sum_grad_squared`` and
``V = N·sum_grad_squared − ḡ²`` (:func:`per_sample_variance`).

**GSNR** (Liu et al., 2020; Cockpit's ``MeanGSNR``): ``ḡ²/(V + ε)``. For pure
noise (``μ = 0``) it does not vanish: ``E[ḡ²] = σ²/N`` and ``E[V] = σ²(N − 1)/N``
put it at about ``1/(N − 1)``; for Gaussian noise it is ``χ²₁/χ²_{N−1}`` with mean
exactly ``1/(N − 3)``.

**Debiased GSNR** (:func:`debiased_gsnr`), an estimator of ``μ²/σ²``:

1. ``ḡ² − S²/N`` is unbiased for ``μ²`` (``E[ḡ²] = μ² + σ²/N``), ``S²`` for ``σ²``
   (any distribution).
2. Their ratio ``ḡ²/S² − 1/N`` is still biased because ``E[1/S²] ≠ 1/σ²``. For
   Gaussian per-sample gradients ``ḡ`` and ``S²`` are independent and
   ``E[1/S²] = (N − 1)/((N − 3)σ²)``, so ``E[ḡ²/S²] = (N − 1)/(N − 3)·(μ²/σ² + 1/N)``.
3. Removing that factor gives ``((N − 3)/(N − 1))·ḡ²/S² − 1/N
   = ((N − 3)·ḡ² − V)/(N·V)``, exactly unbiased for ``μ²/σ²`` under Gaussian
   per-sample gradients (``N ≥ 4``) and zero in expectation on pure noise.

The implemented form adds the stabilizer in the denominator,
``((N − 3)·ḡ² − V)/(N·(V + ε))``, so elements with ``ḡ = V = 0`` (e.g. dead units)
contribute 0. It can be negative; averaging over elements keeps the mean unbiased.

**Gradient noise scale** (McCandlish et al., 2018) ``B_simple = tr(Σ)/|G|²`` with
``Σ`` the per-sample covariance and ``G`` the true gradient, from the sums over
elements ``Σ_j V_j`` and ``|ḡ|² = Σ_j ḡ_j²``:

* plain (:func:`plain_noise_scale`): ``Σ_j V_j/|ḡ|²``; on pure noise it stays near
  ``N − 1`` instead of growing without bound;
* unbiased parts (:func:`unbiased_noise_scale`): ``tr(Σ)^ = N/(N − 1)·Σ_j V_j`` and
  ``|G|²^ = |ḡ|² − tr(Σ)^/N`` are unbiased for ``tr(Σ)`` and ``|G|²`` (any
  distribution), and ``B_simple = tr(Σ)^/|G|²^``; ``+∞`` when ``|G|²^ ≤ 0`` (no
  detectable signal). The ratio is not unbiased itself; McCandlish et al. average
  the numerator and the denominator over steps before dividing, which the two
  returned parts allow.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class NoiseScaleEstimate(NamedTuple):
    """Gradient noise scale and the two estimates it is the ratio of.

    Attributes:
        trace_covariance: Estimate of ``tr(Σ)`` (0-dim tensor).
        squared_gradient_norm: Estimate of ``|G|²`` (0-dim tensor).
        noise_scale: ``trace_covariance/squared_gradient_norm``, ``+∞`` if the
            denominator is ``≤ 0`` (0-dim tensor).
    """

    trace_covariance: Tensor
    squared_gradient_norm: Tensor
    noise_scale: Tensor


def _check_batch_size(batch_size: int, minimum: int, estimate: str = "") -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__}.")
    if batch_size < minimum:
        if not estimate:
            raise ValueError(f"batch_size must be ≥ {minimum} here, got {batch_size}.")
        raise ValueError(
            f"The {estimate} needs a batch of at least {minimum} samples, got "
            f"{batch_size}: a last, smaller batch of an epoch? Drop it "
            "(DataLoader(..., drop_last=True)), or track the diagnostic on other "
            "steps (its schedule)."
        )


def _check_epsilon(epsilon: float) -> None:
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be ≥ 0, got {epsilon}.")


def per_sample_variance(
    grad: Tensor, sum_grad_squared: Tensor, batch_size: int
) -> Tensor:
    """Variance ``V = (1/N) Σ_n (g_n − ḡ)²`` from BackPACK's mean-loss quantities.

    Args:
        grad: Mini-batch gradient ``ḡ`` of the mean loss.
        sum_grad_squared: BackPACK's ``sum_grad_squared = Σ_n (g_n/N)²``, same shape.
        batch_size: Number of samples ``N``.

    Returns:
        ``N·sum_grad_squared − ḡ²``, clipped at 0 against round-off.

    Raises:
        ValueError: If the shapes differ or ``batch_size < 1``.
    """
    _check_batch_size(batch_size, 1)
    if grad.shape != sum_grad_squared.shape:
        raise ValueError(
            f"grad and sum_grad_squared must have equal shapes, got "
            f"{tuple(grad.shape)} and {tuple(sum_grad_squared.shape)}."
        )
    return torch.addcmul(
        batch_size * sum_grad_squared, grad, grad, value=-1
    ).clamp_min_(0)


def gsnr(grad: Tensor, variance: Tensor, epsilon: float) -> Tensor:
    """Elementwise GSNR ``ḡ²/(V + ε)``.

    Args:
        grad: Mini-batch gradient ``ḡ``.
        variance: Per-sample variance ``V`` (``1/N`` normalization), same shape.
        epsilon: Stabilizer ``ε ≥ 0``.

    Returns:
        Tensor shaped like ``grad``.

    Raises:
        ValueError: If ``epsilon < 0``.
    """
    _check_epsilon(epsilon)
    return grad**2 / (variance + epsilon)


def debiased_gsnr(
    grad: Tensor, variance: Tensor, batch_size: int, epsilon: float
) -> Tensor:
    """Elementwise debiased GSNR ``((N − 3)·ḡ² − V)/(N·(V + ε))``.

    Unbiased for ``μ²/σ²`` if the per-sample gradients are Gaussian and ``ε = 0``;
    see the module docstring for the derivation.

    Args:
        grad: Mini-batch gradient ``ḡ``.
        variance: Per-sample variance ``V`` (``1/N`` normalization), same shape.
        batch_size: Number of samples ``N ≥ 4``.
        epsilon: Stabilizer ``ε ≥ 0``.

    Returns:
        Tensor shaped like ``grad`` (entries may be negative).

    Raises:
        ValueError: If ``batch_size < 4`` or ``epsilon < 0``.
    """
    _check_batch_size(batch_size, 4, "debiased GSNR")
    _check_epsilon(epsilon)
    return ((batch_size - 3) * grad**2 - variance) / (batch_size * (variance + epsilon))


def gsnr_sums(
    grad: Tensor, variance: Tensor, batch_size: int, epsilon: float
) -> tuple[Tensor, Tensor]:
    """Sums over all elements of :func:`gsnr` and :func:`debiased_gsnr`, fused.

    With ``r = ḡ²/(V + ε)`` and ``q = V/(V + ε)``, the debiased GSNR is
    ``((N − 3)·r − q)/N``, so both sums follow from ``Σ r`` and ``Σ q`` without
    forming the elementwise tensors twice (the diagnostics record only means).

    Args:
        grad: Mini-batch gradient ``ḡ``.
        variance: Per-sample variance ``V`` (``1/N`` normalization), same shape.
        batch_size: Number of samples ``N ≥ 4``.
        epsilon: Stabilizer ``ε ≥ 0``.

    Returns:
        ``(Σ GSNR, Σ debiased GSNR)`` as 0-dim tensors.

    Raises:
        ValueError: If ``batch_size < 4`` or ``epsilon < 0``.
    """
    _check_batch_size(batch_size, 4, "debiased GSNR")
    _check_epsilon(epsilon)
    inverse = (variance + epsilon).reciprocal_()
    plain_sum = torch.dot(grad.flatten().square(), inverse.flatten())
    ratio_sum = torch.dot(variance.flatten(), inverse.flatten())
    return plain_sum, ((batch_size - 3) * plain_sum - ratio_sum) / batch_size


def plain_noise_scale(
    squared_gradient_norm: Tensor, variance_sum: Tensor
) -> NoiseScaleEstimate:
    """Noise scale from the plain (biased) estimates: ``Σ_j V_j/|ḡ|²``.

    Args:
        squared_gradient_norm: ``|ḡ|²`` (0-dim tensor).
        variance_sum: ``Σ_j V_j`` (0-dim tensor).

    Returns:
        The two inputs and their ratio (``+∞`` where ``|ḡ|² = 0``).
    """
    return NoiseScaleEstimate(
        variance_sum,
        squared_gradient_norm,
        _ratio_or_inf(variance_sum, squared_gradient_norm),
    )


def unbiased_noise_scale(
    squared_gradient_norm: Tensor, variance_sum: Tensor, batch_size: int
) -> NoiseScaleEstimate:
    """Noise scale from the unbiased estimates of ``tr(Σ)`` and ``|G|²``.

    Args:
        squared_gradient_norm: ``|ḡ|²`` (0-dim tensor).
        variance_sum: ``Σ_j V_j`` (0-dim tensor).
        batch_size: Number of samples ``N ≥ 2``.

    Returns:
        ``tr(Σ)^ = N/(N − 1)·Σ_j V_j``, ``|G|²^ = |ḡ|² − tr(Σ)^/N`` and their ratio
        (``+∞`` where ``|G|²^ ≤ 0``).

    Raises:
        ValueError: If ``batch_size < 2``.
    """
    _check_batch_size(batch_size, 2, "unbiased noise scale")
    trace = variance_sum * (batch_size / (batch_size - 1))
    norm = squared_gradient_norm - trace / batch_size
    return NoiseScaleEstimate(trace, norm, _ratio_or_inf(trace, norm))


def _ratio_or_inf(numerator: Tensor, denominator: Tensor) -> Tensor:
    positive = denominator > 0
    safe = torch.where(positive, denominator, torch.ones_like(denominator))
    return torch.where(
        positive, numerator / safe, torch.full_like(numerator, torch.inf)
    )
