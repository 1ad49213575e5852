"""Bases: which eigen-directions of a param group's GGN block the step moves along.

* :class:`KroneckerBasis` (the default): per layer, the eigenvectors ``u_i ⊗ v_j`` of
  the Kronecker factors of the layer's GGN block (K-FAC's factors of the GGN's square
  root; :mod:`dampednewton.math.kronecker`). Every direction of the layer is kept,
  with its own curvature ``τ_i σ_j`` and damping; a factor larger than ``rank`` keeps
  its ``rank`` leading eigenvectors and treats the rest of its space as one
  eigenvalue. Covers ``nn.Linear`` and ``nn.Conv1d/2d/3d`` (one group, zero padding
  given by numbers).
* :class:`GramBasis`: the leading eigenvectors of the whole group's GGN block, from
  the small Gram matrix ``VᵀV`` (ViViT's route); the ``criterion`` picks them, the
  ``complement`` covers the rest of the gradient. Any layer BackPACK supports.

Both are picklable frozen dataclasses (``_target_``-selectable in Hydra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dampednewton.policies.damping import (
    ConstantDamping,
    Damping,
    LevenbergMarquardt,
)
from dampednewton.policies.noise_filter import NoiseFilter

DEFAULT_KRONECKER_RANK = 32
"""Eigenvectors kept per Kronecker factor larger than :data:`DEFAULT_EXACT_SIZE`."""
DEFAULT_EXACT_SIZE = DEFAULT_KRONECKER_RANK
"""Kronecker factors up to this dimension are decomposed exactly. Every larger factor
keeps ``rank`` eigenvectors: exact up to 160 dimensions took 70 instead of 90 steps to
0.6 on the MNIST-1D MLP but 16 % more time to 0.9 on its CNN (docs/benchmarks.md)."""
ROTATING_REFRESHES = 5
"""Refreshes that all recompute the eigenvectors (the ramp of the default schedule:
steps 0, 1, 3, 7, 15), while the factors change fast."""


@dataclass(frozen=True)
class KroneckerBasis:
    """Per layer, the eigenbasis of the Kronecker factors of its GGN block.

    Attributes:
        rank: Eigenvectors kept per factor larger than ``exact_size`` (``≥ 1``): such
            a factor (e.g. the 785 inputs of a 784-wide layer with bias) keeps its
            ``rank`` leading ones and replaces its other eigenvalues by their mean. A
            step costs four products of each such layer's gradient with ``rank``
            vectors.
        exact_size: Factors of dimension up to this (``≥ 0``) are decomposed
            exactly, every eigenvector kept.
        rotation_interval: Recompute the eigenvectors on the first
            :data:`ROTATING_REFRESHES` refreshes and then on every
            ``rotation_interval``-th (``≥ 1``; the default 1: on every refresh, each
            past ``solved_rotations`` one QR); the refreshes in between update the
            factors and only the eigenvalues along the kept eigenvectors (their
            Rayleigh quotients): an averaged factor turns slowly.
        solved_rotations: Rotations that solve each factor's small symmetric
            eigenproblem (the Rayleigh-Ritz step after a subspace iteration, or the
            whole factor up to ``exact_size``; ``≥ 0``, the first refresh always
            does). Later rotations take one subspace iteration from the previous
            eigenvectors, orthonormalized by QR (SOAP's update): no eigensolver,
            and on a GPU no synchronization. ``None``: every rotation solves.
        noise_filter: Scale each kept direction's Newton coefficient by its
            gradient's steadiness (:class:`NoiseFilter`, SOAP's moments in the
            eigenbasis); ``None`` (the default) for the plain damped Newton step.
        packed: Step a group's layers in few batches, each layer zero-padded to the
            largest of its batch (a batch's padding stays within four times its
            layers' entries): a fixed number of operators per batch whatever the
            number and shapes of the layers, for the price of the padded products.
            It pays where a step's time is its kernel launches (small models on a
            GPU); on a CPU the products' sizes decide. ``None`` (the default): packed
            on a CUDA device, not on a CPU. Steps with a noise filter or an adaptive
            damping, and groups whose layers differ in dtype or device, are taken
            unpacked.
        graphed: When packed, on a CUDA device: record each pack's math (the
            products and the slope, after its gradients are copied into the pack's
            buffer) as a CUDA graph on its second step and replay it for the run
            (refreshes and damping changes copy their values into the buffers it
            reads): one launch instead of the math's kernels. On a CPU the packed
            math runs as it is. ``None`` (the default): graphed wherever packed (on
            an H100, packed and graphed steps reached 0.9 on fmnist_2c2d 1.2-1.3x
            sooner than unpacked ones, at a peak memory of 793 against 659 MiB,
            docs/performance.md).
    """

    rank: int = DEFAULT_KRONECKER_RANK
    exact_size: int = DEFAULT_EXACT_SIZE
    rotation_interval: int = 1
    solved_rotations: int | None = ROTATING_REFRESHES
    noise_filter: NoiseFilter | None = None
    packed: bool | None = None
    graphed: bool | None = None

    def __post_init__(self) -> None:
        """Validate the settings."""
        for name, least in (("rank", 1), ("exact_size", 0), ("rotation_interval", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"KroneckerBasis needs an integer {name} >= {least}, got {value!r}."
                )
            if value < least:
                raise ValueError(
                    f"KroneckerBasis needs an integer {name} >= {least}, got {value!r}."
                )
        solved = self.solved_rotations
        if solved is not None and (
            isinstance(solved, bool) or not isinstance(solved, int) or solved < 0
        ):
            raise ValueError(
                "KroneckerBasis needs solved_rotations=None or an integer >= 0, got "
                f"{solved!r}."
            )
        for name in ("packed", "graphed"):
            if getattr(self, name) is not None and not isinstance(
                getattr(self, name), bool
            ):
                raise TypeError(
                    f"KroneckerBasis needs {name}=True, False or None (by device), "
                    f"got {getattr(self, name)!r}."
                )
        if self.graphed and self.packed is False:
            raise ValueError(
                "KroneckerBasis(graphed=True) needs the layers packed: the CUDA graph "
                "replays the packed layers' math on their gradient buffer. Use "
                "KroneckerBasis(packed=True, graphed=True), or leave packed=None "
                "(packed on a CUDA device)."
            )
        if self.noise_filter is not None and not isinstance(
            self.noise_filter, NoiseFilter
        ):
            raise TypeError(
                "KroneckerBasis needs noise_filter=NoiseFilter(...) or None, got "
                f"{self.noise_filter!r}."
            )

    def packs(self, device: torch.device) -> bool:
        """Whether groups on ``device`` are stepped packed.

        Args:
            device: The group's device.

        Returns:
            ``packed``, or for ``None`` whether ``device`` is a CUDA device.
        """
        return device.type == "cuda" if self.packed is None else self.packed

    def graphs(self, device: torch.device) -> bool:
        """Whether packed groups on ``device`` replay their math as CUDA graphs.

        Args:
            device: The group's device.

        Returns:
            ``False`` off CUDA devices, else ``graphed`` (``None``: ``True``).
        """
        return device.type == "cuda" and self.graphed is not False

    def kept(self, dim: int) -> int:
        """Eigenvectors kept of a factor of dimension ``dim``.

        Args:
            dim: The factor's dimension.

        Returns:
            ``dim`` up to ``exact_size``, else ``min(dim, rank)``.
        """
        return dim if dim <= self.exact_size else min(dim, self.rank)

    def solves(self, refresh: int) -> bool:
        """Whether rotating refresh number ``refresh`` solves the eigenproblems.

        Args:
            refresh: Refreshes before this one.

        Returns:
            ``True`` for the first ``solved_rotations`` refreshes (all of them for
            ``None``); later rotations take a QR-orthonormalized subspace iteration.
        """
        return self.solved_rotations is None or refresh < self.solved_rotations

    def rotates(self, refresh: int) -> bool:
        """Whether refresh number ``refresh`` (from 0) recomputes the eigenvectors.

        Args:
            refresh: Refreshes before this one.

        Returns:
            ``True`` on the first :data:`ROTATING_REFRESHES` and every
            ``rotation_interval``-th after them.
        """
        if refresh < ROTATING_REFRESHES:
            return True
        return (refresh - ROTATING_REFRESHES) % self.rotation_interval == 0


@dataclass(frozen=True)
class GramBasis:
    """The leading eigenvectors of the group's GGN block, from its Gram matrix.

    The ``criterion`` chooses them, the ``complement`` steps along the rest of the
    gradient, ``newton_fraction`` scales the Newton part (ViViT's step with the
    package's additions, see the optimizer's docstring).
    """


def check_kronecker_damping(damping: Damping) -> None:
    """Refuse dampings the Kronecker basis cannot apply.

    The Kronecker basis damps every direction of a layer with K-FAC's factored
    Tikhonov rule from one number ``δ``: a constant or Levenberg-Marquardt's.

    Args:
        damping: The group's damping policy.

    Raises:
        ValueError: For any other policy.
    """
    if not isinstance(damping, ConstantDamping | LevenbergMarquardt):
        raise ValueError(
            "The Kronecker basis damps each layer's directions from one number δ "
            "(K-FAC's factored Tikhonov damping): use a number, ConstantDamping or "
            f"LevenbergMarquardt, got {type(damping).__name__}. Policies that set a "
            "damping per GGN eigen-direction need basis=GramBasis()."
        )


Basis = KroneckerBasis | GramBasis
"""The bases a param group can take."""


def as_basis(basis: Any) -> Basis:
    """Check a group's basis.

    Args:
        basis: A :class:`KroneckerBasis` or :class:`GramBasis`.

    Returns:
        The basis.

    Raises:
        TypeError: For anything else.
    """
    if isinstance(basis, KroneckerBasis | GramBasis):
        return basis
    raise TypeError(
        "basis must be KroneckerBasis() (per layer, the default) or GramBasis() "
        f"(the group's leading GGN eigenvectors, ViViT's route), got {basis!r}."
    )


# Loadable with torch.load(weights_only=True), as every policy of the param groups.
torch.serialization.add_safe_globals([KroneckerBasis, GramBasis])
