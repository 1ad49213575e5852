"""One parameter group's update direction: ViViT's step, complement, averaging.

:class:`StepFinisher` turns a reduced GGN block into the optimizer's step, as
ViViT's damped Newton computation does, plus what belongs to the optimizer: the
fraction ``φ`` of the Newton step taken along the kept directions, the
complement step (:mod:`dampednewton.policies.complement`) and the
curvature averaged across steps (:mod:`dampednewton.averaging`). Each group's result
is a :class:`GroupStep`: the direction ``s`` (before the learning rate) with its
slope ``ḡᵀs`` and curvature ``sᵀGs`` for the quadratic model
(:mod:`dampednewton._step.quadratic_model`), and, for averaged groups, the updated
factor to commit once the step is accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dampednewton._step.averaged_step import (
    averaged_step,
    checked_policy_damping,
    empty_factor,
    group_gradients,
)
from dampednewton._step.group_result import AveragedFactor, GroupStep
from dampednewton._step.step_block import block_of
from dampednewton.averaging import CurvatureAveraging
from dampednewton.computations.block import (
    Block,
    mean_gradient_of,
    mean_gradient_products,
    slope_products,
    to_parameter_space,
)
from dampednewton.computations.directional_derivatives import slopes_and_curvatures
from dampednewton.computations.selection import diagonalize
from dampednewton.math.averaged_gram import (
    averaged_gram,
    leading_eigenpairs,
    rotated_basis,
    split_mixing,
)
from dampednewton.math.complement import (
    complement_coefficients,
    complement_rayleigh_quotient,
    gram_projections,
    orthogonal_energy,
    squared_norm,
)
from dampednewton.math.finite import finite_flag
from dampednewton.math.gram_space import (
    gram_space_step,
    inverse_lengths,
    newton_coefficients,
)
from dampednewton.math.precision import source_dtype


class StepFinisher:
    """Finishes a group's GGN block into its :class:`GroupStep`.

    The optimizer's :class:`~dampednewton.computations.engine.GGNEngine` calls it
    after the backward pass (the complement and averaging read the full ``.grad``).
    Each block's group carries its :class:`~dampednewton._step.step_block.StepBlock`
    (the group's options and averaged factor so far). A block whose GGN is not
    finite gives a step flagged in :attr:`GroupStep.curvature_finite` (read with the
    step's other checks, see :mod:`dampednewton._step.step_status`); one whose
    eigensolver fails gives ``None`` and is recorded in
    :attr:`eigensolver_succeeded`. Either way the closure returns its loss and the
    optimizer refuses the step with a clear message.

    Attributes:
        per_sample_gradients: Whether blocks reduce per-sample gradients (else the
            slopes come from the mean gradient in ``.grad``).
        subsampling_grad: The samples of the per-sample gradients (``None``: all).
        eigensolver_succeeded: Whether every block's eigensolver succeeded since
            :meth:`reset`.
    """

    def __init__(
        self, *, per_sample_gradients: bool, subsampling_grad: Sequence[int] | None
    ):
        """Configure the finisher.

        Args:
            per_sample_gradients: See the attribute.
            subsampling_grad: See the attribute.
        """
        self.per_sample_gradients = per_sample_gradients
        self.subsampling_grad = subsampling_grad
        self.eigensolver_succeeded = True

    def reset(self) -> None:
        """Start a new step: every eigensolver succeeded so far."""
        self.eigensolver_succeeded = True

    def __call__(self, block: Block) -> GroupStep | None:
        """The group's step, or ``None`` when its curvature is unusable.

        Args:
            block: The group's block, all of its parameters reduced.

        Returns:
            The step.
        """
        try:
            averaging = block_of(block).options.averaging
            if averaging is None:
                return self._newton_step(block)
            return self._averaged_step(block, averaging)
        except (FloatingPointError, torch.linalg.LinAlgError):
            # A non-finite Gram matrix, or the eigensolver failed on a hopeless one.
            self.eigensolver_succeeded = False
            return None

    def _newton_step(self, block: Block) -> GroupStep:
        """ViViT's step from this batch's GGN, plus the complement if switched on.

        Directions whose eigenvalue is not numerically positive get a zero
        coefficient and stay out of the complement's curvature and projections, so
        the step equals the one restricted to the positive eigenvalues. A Gram
        matrix that is not finite is replaced by zeros (no NaN reaches the
        eigensolver) and flagged in :attr:`GroupStep.curvature_finite`.
        """
        options = block_of(block).options
        gram = block.reduced_gram
        finite = finite_flag(gram.diagonal())
        source = source_dtype(block.group["params"])
        directions = diagonalize(gram.where(finite, 0.0), options.criterion, source)
        evals, gram_evecs = directions.evals, directions.gram_evecs
        positive, lengths = directions.positive, directions.lengths
        products = slope_products(block, self.per_sample_gradients)
        gammas, lambdas = slopes_and_curvatures(block, directions, products)
        damping, valid = checked_policy_damping(
            options.damping, evals, gram_evecs, gammas, lambdas
        )
        gamma_mean, lambda_mean = gammas.mean(0), lambdas.mean(0)
        coefficients = options.newton_fraction * newton_coefficients(
            gamma_mean, lambda_mean, damping
        ).where(positive, 0.0)
        details: dict[str, Any] = {
            "evals": evals,
            "gamma_mean": gamma_mean,
            "lambda_mean": lambda_mean,
            "damping": damping,
            "coefficients": coefficients,
            "selected": directions.selected,
            "curvature_finite": finite,
            "damping_valid": valid,
        }
        policy = options.complement
        rho = None
        if policy is not None:
            projections, residual = gram_projections(
                self._mean_gradient_products(block, products),
                gram_evecs,
                positive,
                inverse_lengths(lengths),
            )
            gradients = group_gradients(block.group["params"])
            energy = orthogonal_energy(squared_norm(gradients), projections)
            measured = complement_rayleigh_quotient(residual, energy)
            # An infinite damping keeps a direction out of the policy's choice.
            rho = policy(lambda_mean, damping.where(positive, torch.inf), measured)
        if rho is None:
            beta = gram_space_step(coefficients, gram_evecs, lengths)
            return GroupStep(
                direction=tuple(to_parameter_space(block, beta)),
                slope=torch.sum(gamma_mean * coefficients),
                curvature=(curvature := torch.sum(lambda_mean * coefficients**2)),
                batch_curvature=curvature,
                **details,
            )
        rho = rho.to(evals)
        beta = gram_space_step(
            complement_coefficients(coefficients, projections, rho), gram_evecs, lengths
        )
        mapped = to_parameter_space(block, beta)
        return GroupStep(
            direction=tuple(
                m - g / rho for m, g in zip(mapped, gradients, strict=True)
            ),
            slope=torch.sum(projections * coefficients) - energy / rho,
            curvature=(
                curvature := torch.sum(lambda_mean * coefficients**2)
                + residual.square().sum() / rho**2
            ),
            batch_curvature=curvature,
            complement_curvature=rho,
            **details,
        )

    def _mean_gradient_products(self, block: Block, products: Tensor) -> Tensor:
        """``ḡᵀV`` (``[1, C·N]``) for the whole batch's mean gradient ``ḡ``."""
        if not self.per_sample_gradients or self.subsampling_grad is None:
            return products.mean(0, keepdim=True)
        return mean_gradient_products(block, mean_gradient_of)

    def _averaged_step(self, block: Block, averaging: CurvatureAveraging) -> GroupStep:
        """Average this batch's GGN into the group's factor, then step along it.

        A Gram matrix that is not finite is replaced by zeros and flagged in
        :attr:`GroupStep.curvature_finite`, as in :meth:`_newton_step`.
        """
        group = block_of(block)
        gram = block.reduced_gram
        finite = finite_flag(gram.diagonal())
        gram = gram.where(finite, 0.0)
        previous = group.factor or empty_factor(group.params, gram)
        rank = previous.weights.numel()
        cross = gram.new_zeros(rank, gram.shape[0])
        basis_gram = gram.new_zeros(rank, rank)
        for param, param_basis in zip(group.params, previous.basis, strict=True):
            if id(param) in block.factors and rank:
                cross += block.factors[id(param)].vector_products(param_basis)
                columns = param_basis.flatten(1).to(basis_gram)
                basis_gram += columns @ columns.T
        small = averaged_gram(
            basis_gram, cross.where(finite, 0.0), gram, averaging.decay
        )
        rank_kept = averaging.rank_for(group.options.criterion)
        weights, mixing = leading_eigenpairs(
            small, rank_kept, source_dtype(group.params)
        )
        of_basis, of_batch = split_mixing(mixing, rank, averaging.decay)
        mapped = to_parameter_space(block, of_batch)
        basis = rotated_basis(previous.basis, mapped, of_basis)
        factor = AveragedFactor(basis, weights, previous.updates + 1)
        mean_products = self._mean_gradient_products(
            block, slope_products(block, self.per_sample_gradients)
        )
        step = averaged_step(
            group,
            factor,
            batch_products=cross.T @ of_basis + gram @ of_batch,
            mean_products=mean_products.squeeze(0),
        )
        step.curvature_finite = finite
        return step
