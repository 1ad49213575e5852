"""A refresh's eigenpairs of layers' averaged factors: queued, then solved together.

A refresh that rotates the eigenbases (:meth:`~dampednewton.KroneckerBasis.rotates`)
decomposes every factor anew; the others refresh the eigenvalues along the stored
eigenvectors (Rayleigh quotients, no eigensolver). :func:`decomposed` queues a layer
batch's eigenproblems on the refresh's
:class:`~dampednewton.math.kronecker_factors.FactorEigenBatch`, which solves those of
one size in one batched ``eigh`` (one call, and on a GPU one synchronization, per
size rather than per factor); :meth:`Decomposed.eigenpairs` then picks the batch's
eigenpairs from the solved list. Rotations past
:attr:`~dampednewton.KroneckerBasis.solved_rotations` need no eigensolver: one
QR-orthonormalized subspace iteration from the stored eigenvectors
(:func:`~dampednewton.math.kronecker_factors.power_rotated`), queued likewise on the
refresh's :class:`~dampednewton.math.kronecker_rotation.RotationBatch` (on a GPU
every factor's QR in one padded batch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dampednewton._step.kronecker_state import INPUT_EIGEN, OUTPUT_EIGEN, stored_eigen
from dampednewton.math.kronecker import stacked_eigen
from dampednewton.math.kronecker_factors import (
    FactorEigen,
    FactorEigenBatch,
    refreshed_values,
)
from dampednewton.math.kronecker_rotation import RotationBatch
from dampednewton.policies.basis import KroneckerBasis


@dataclass(frozen=True)
class Decomposed:
    """A layer batch's eigenpairs ``(S, A)``: refreshed already, or queued.

    Attributes:
        refreshed: The eigenpairs along the stored eigenvectors (no eigensolver).
        queued: The positions of ``(S, A)`` in the solved list.
        rotated: The positions of ``(S, A)`` in the rotated list.
        layers: Per layer, its own decomposition, stacked afterwards (layers whose
            stored eigenpairs differ in kind).
    """

    refreshed: tuple[FactorEigen, FactorEigen] | None = None
    queued: tuple[int, int] | None = None
    rotated: tuple[int, int] | None = None
    layers: tuple[Decomposed, ...] = ()

    def eigenpairs(
        self, solved: Sequence[FactorEigen], rotated: Sequence[FactorEigen]
    ) -> tuple[FactorEigen, FactorEigen]:
        """``(S, A)``, with the queued eigenproblems' solutions and rotations."""
        if self.refreshed is not None:
            return self.refreshed
        if self.queued is not None:
            return solved[self.queued[0]], solved[self.queued[1]]
        if self.rotated is not None:
            return rotated[self.rotated[0]], rotated[self.rotated[1]]
        each = [layer.eigenpairs(solved, rotated) for layer in self.layers]
        return (
            stacked_eigen([output for output, _ in each]),
            stacked_eigen([input_side for _, input_side in each]),
        )


def decomposed(
    basis: KroneckerBasis,
    stored: Sequence[Mapping[str, Any]],
    inputs: Tensor,
    outputs: Tensor,
    rotate: bool,
    eigen_batch: FactorEigenBatch,
    rotations: RotationBatch,
    solve: bool = True,
) -> Decomposed:
    """Eigenpairs of layers' averaged factors ``(S, A)`` for this refresh.

    Rotating refreshes (``rotate``: :meth:`KroneckerBasis.rotates`, or every refresh
    without averaging) queue the factors on ``eigen_batch`` to be decomposed anew;
    the others refresh the eigenvalues along the stored eigenvectors. A rotating
    refresh that does not ``solve`` (:meth:`KroneckerBasis.solves`) queues one
    QR-orthonormalized subspace iteration of the stored eigenvectors on
    ``rotations`` instead
    (:func:`~dampednewton.math.kronecker_factors.power_rotated`). ``stored``
    holds each layer's state; with several layers the factors are stacked
    ``[L, d, d]`` and decomposed together, unless the layers' stored eigenpairs
    differ in kind (some stored, some not, or of other shapes): then each layer is
    decomposed alone and the results stacked.
    """
    previous = [
        (stored_eigen(entry, OUTPUT_EIGEN), stored_eigen(entry, INPUT_EIGEN))
        for entry in stored
    ]
    if len(previous) > 1 and not _alike(previous):
        return Decomposed(
            layers=tuple(
                decomposed(
                    basis,
                    [entry],
                    input_side,
                    output,
                    rotate,
                    eigen_batch,
                    rotations,
                    solve,
                )
                for entry, output, input_side in zip(
                    stored, outputs.unbind(0), inputs.unbind(0), strict=True
                )
            )
        )
    output, input_eigen = previous[0]
    if len(previous) > 1 and output is not None and input_eigen is not None:
        outputs_before = [pair[0] for pair in previous if pair[0] is not None]
        inputs_before = [pair[1] for pair in previous if pair[1] is not None]
        output, input_eigen = (
            stacked_eigen(outputs_before),
            stacked_eigen(inputs_before),
        )
    if (
        rotate
        and not solve
        and _rotatable(output, outputs, basis)
        and _rotatable(input_eigen, inputs, basis)
    ):
        assert output is not None and input_eigen is not None
        return Decomposed(
            rotated=(rotations.add(outputs, output), rotations.add(inputs, input_eigen))
        )
    if output is None or input_eigen is None or rotate:
        return Decomposed(
            queued=(
                eigen_batch.add(
                    outputs,
                    basis.kept(outputs.shape[-1]),
                    None if output is None else output.vectors,
                ),
                eigen_batch.add(
                    inputs,
                    basis.kept(inputs.shape[-1]),
                    None if input_eigen is None else input_eigen.vectors,
                ),
            )
        )
    return Decomposed(
        refreshed=(
            refreshed_values(outputs, output),
            refreshed_values(inputs, input_eigen),
        )
    )


def _rotatable(
    eigen: FactorEigen | None, factor: Tensor, basis: KroneckerBasis
) -> bool:
    """Whether stored eigenvectors can be rotated into ``factor``'s kept ones."""
    if eigen is None:
        return False
    dim = factor.shape[-1]
    return tuple(eigen.vectors.shape) == (*factor.shape[:-1], basis.kept(dim))


def _alike(previous: list[tuple[FactorEigen | None, FactorEigen | None]]) -> bool:
    """Whether every layer's stored eigenpairs are absent, or present in one shape."""
    kinds = {
        tuple(None if eigen is None else tuple(eigen.vectors.shape) for eigen in pair)
        for pair in previous
    }
    return len(kinds) == 1
