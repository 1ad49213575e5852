"""Stochastic quadratic problems written as a linear model with an MSE loss.

Both quadratics have per-sample losses ``ℓ_n(θ) = ½ (θ − x_n)ᵀ H (θ − x_n)`` with a
fixed symmetric positive (semi-)definite ``H`` and random "data" ``x_n``. To make them
trainable by any ``torch.optim`` optimizer *and* by BackPACK (whose GGN is then exactly
``H``), they are expressed through a read-out matrix ``S`` with ``SᵀS = (D/2)·H``:

* the model maps a constant input ``1`` to ``S θ`` (``θ`` is the weight of a
  ``Linear(1, D)``; ``S`` is a frozen ``Linear(D, D)``),
* the target of sample ``n`` is ``S x_n``,
* ``MSELoss(reduction="mean")`` averages ``‖S(θ − x_n)‖²`` over the ``N·D`` entries,
  which equals the mini-batch mean of ``ℓ_n`` because of the factor ``D/2``.

``quadratic_deep`` follows DeepOBS's test problem of the same name: ``D = 100``,
eigenvalues of ``H`` drawn once from a fixed seed, 90 uniformly from ``[0, 1]`` and 10
uniformly from ``[30, 60]`` (the "bulk plus outliers" spectrum reported for deep
nets), rotated by a Haar-random rotation ``R`` (``H = Rᵀ diag(λ) R``); 1000 training
and 1000 test samples ``x_n ~ N(0, 0.6² I)`` (train and test drawn from different
fixed seeds), and ``θ₀ = 1``. DeepOBS draws ``R`` with the subgroup algorithm and
NumPy's legacy generator, here it is a QR-based draw from ``numpy.random.default_rng``:
same distribution and spectrum recipe, not the same matrix.

``noisy_quadratic`` is the gradient-noise toy problem of ViViT's damping experiment:
``D = 20``, eigenvalues ``1², 2², …, 20²`` (optionally rotated), ``θ₀ = 100·1``. The
samples ``x_n = H⁻¹ ξ_n`` with ``ξ_n ~ N(0, σ² I)`` make the per-sample gradient
``H(θ − x_n) = Hθ − ξ_n`` the exact gradient plus isotropic noise of variance ``σ²``
per direction, while the curvature is noise-free. The population minimizer is
``θ* = E[x] = 0``, so the excess loss ``E_x[ℓ(θ, x)] − E_x[ℓ(θ*, x)] = ½ θᵀHθ``; its
"test set" is the single point ``x = 0``, whose loss is exactly that excess loss.
"""

from __future__ import annotations

import math

import numpy as np


def haar_rotation(dim: int, rng: np.random.Generator) -> np.ndarray:
    """Draw a rotation matrix uniformly (Haar measure) from SO(dim).

    QR-decomposes a standard normal matrix and fixes the signs so that the
    distribution is uniform (Mezzadri, 2007), then flips one row if needed to get
    determinant +1.

    Args:
        dim: Matrix size, at least 1.
        rng: Source of randomness.

    Returns:
        An orthogonal ``dim × dim`` float64 matrix with determinant 1.

    Raises:
        ValueError: If ``dim < 1``.
    """
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}.")
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[0] = -q[0]
    return q


def deepobs_eigenvalues(rng: np.random.Generator) -> np.ndarray:
    """DeepOBS's ``quadratic_deep`` spectrum: 90 values in [0, 1], 10 in [30, 60].

    Args:
        rng: Source of randomness.

    Returns:
        The 100 eigenvalues (unsorted: bulk first, outliers last).
    """
    return np.concatenate([rng.uniform(0.0, 1.0, 90), rng.uniform(30.0, 60.0, 10)])


def mse_readout(eigenvalues: np.ndarray, rotation: np.ndarray) -> np.ndarray:
    """Read-out ``S`` with ``SᵀS = (D/2)·H`` for ``H = Rᵀ diag(eigenvalues) R``.

    Args:
        eigenvalues: The ``D`` non-negative eigenvalues of ``H``.
        rotation: Orthogonal ``D × D`` matrix ``R``.

    Returns:
        ``S = sqrt(D/2) · diag(sqrt(eigenvalues)) · R``.

    Raises:
        ValueError: For negative eigenvalues or mismatched shapes.
    """
    dim = eigenvalues.shape[0]
    if rotation.shape != (dim, dim):
        raise ValueError(
            f"rotation must be {dim}×{dim} to match {dim} eigenvalues, "
            f"got {rotation.shape}."
        )
    if (eigenvalues < 0).any():
        raise ValueError("The eigenvalues of a quadratic's Hessian must be >= 0.")
    return math.sqrt(dim / 2) * np.sqrt(eigenvalues)[:, None] * rotation


def hessian_from_readout(readout: np.ndarray) -> np.ndarray:
    """Recover ``H = (2/D)·SᵀS`` from the read-out of :func:`mse_readout`.

    Args:
        readout: The ``D × D`` read-out matrix ``S``.

    Returns:
        The Hessian ``H`` of the per-sample loss.
    """
    return (2.0 / readout.shape[0]) * readout.T @ readout


def deepobs_readout(seed: int = 42) -> np.ndarray:
    """Read-out matrix of ``quadratic_deep`` (DeepOBS spectrum, Haar rotation).

    Args:
        seed: Seed of the eigenvalues and the rotation, a fixed property of the problem.

    Returns:
        The ``100 × 100`` read-out ``S``.
    """
    rng = np.random.default_rng(seed)
    eigenvalues = deepobs_eigenvalues(rng)
    return mse_readout(eigenvalues, haar_rotation(eigenvalues.shape[0], rng))


def squares_readout(dim: int = 20, rotate: bool = True, seed: int = 0) -> np.ndarray:
    """Read-out matrix of ``noisy_quadratic``: eigenvalues ``1², …, dim²``.

    Args:
        dim: Dimension ``D``.
        rotate: Rotate the eigenbasis by a Haar-random rotation (otherwise ``H`` is
            diagonal, which favours per-coordinate methods such as Adam).
        seed: Seed of the rotation.

    Returns:
        The ``dim × dim`` read-out ``S``.
    """
    eigenvalues = np.arange(1, dim + 1, dtype=np.float64) ** 2
    rotation = (
        haar_rotation(dim, np.random.default_rng(seed)) if rotate else np.eye(dim)
    )
    return mse_readout(eigenvalues, rotation)


def gaussian_samples(num: int, dim: int, std: float, seed: int) -> np.ndarray:
    """Isotropic Gaussian "data" ``x_n ~ N(0, std² I)`` of ``quadratic_deep``.

    Args:
        num: Number of samples.
        dim: Dimension.
        std: Standard deviation of every coordinate.
        seed: Seed (DeepOBS uses 42 for training, 43 for test data).

    Returns:
        A ``num × dim`` float64 array.
    """
    return np.random.default_rng(seed).normal(0.0, std, size=(num, dim))


def gradient_noise_samples(
    readout: np.ndarray, num: int, gradient_noise_std: float, seed: int
) -> np.ndarray:
    """Samples ``x_n = H⁻¹ ξ_n``, ``ξ_n ~ N(0, σ² I)``: isotropic gradient noise.

    Args:
        readout: Read-out ``S`` of the quadratic (``H`` must be invertible).
        num: Number of samples.
        gradient_noise_std: Standard deviation ``σ`` of the per-sample gradient noise.
        seed: Seed of ``ξ``.

    Returns:
        A ``num × D`` float64 array.
    """
    hessian = hessian_from_readout(readout)
    xi = np.random.default_rng(seed).normal(
        0.0, gradient_noise_std, size=(num, hessian.shape[0])
    )
    return np.linalg.solve(hessian, xi.T).T
