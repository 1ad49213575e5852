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
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from dampednewton.averaging import (
    CurvatureAveraging,
    averaged_gram,
    bias_corrected,
    leading_eigenpairs,
    split_mixing,
)
from dampednewton.computations.block import (
    Block,
    gradient_of,
    mean_gradient_products,
    slope_products,
    to_parameter_space,
)
from dampednewton.computations.damped_newton import NewtonStep
from dampednewton.computations.directional_derivatives import slopes_and_curvatures
from dampednewton.computations.selection import diagonalize
from dampednewton.math.finite import finite_flag
from dampednewton.math.frozen_basis import FrozenBasis, freeze
from dampednewton.math.gram_space import (
    gram_space_step,
    inverse_lengths,
    newton_coefficients,
)
from dampednewton.math.precision import computation_dtype, upcast
from dampednewton.policies.complement import (
    as_complement,
    complement_coefficients,
    complement_rayleigh_quotient,
    orthogonal_energy,
)
from dampednewton.policies.criteria import (
    as_criterion,
    selected_indices,
    top_k_start,
)
from dampednewton.policies.damping import (
    as_damping,
    checked_damping_shape,
    trusts_its_values,
    valid_damping_flag,
)


@dataclass
class AveragedFactor:
    """A group's averaged GGN ``B Bᵀ`` after ``updates`` updates (not bias-corrected).

    Attributes:
        basis: Per parameter of the group, ``B``'s columns ``[r, *p.shape]``.
        weights: ``w = diag(BᵀB)`` ``[r]``, ascending.
        updates: Number of batches averaged in (``t``).
    """

    basis: tuple[Tensor, ...]
    weights: Tensor
    updates: int


@dataclass
class GroupStep(NewtonStep):
    """A group's direction ``s`` (field ``step``) and its quadratic model.

    Its ``coefficients`` are those of the step taken: the Newton fraction ``φ`` times
    the damped Newton coefficients ``−γ̄_k/(λ̄_k + δ_k)``.

    Attributes:
        slope: ``ḡᵀs`` (scalar tensor).
        curvature: ``sᵀGs`` under the step's GGN estimate (scalar tensor).
        batch_curvature: ``sᵀĜs`` under this batch's GGN ``Ĝ = VVᵀ`` where it was
            computed (``None`` on steps that reuse an averaged factor).
        complement_curvature: ``ρ`` of the complement step, ``None`` without one
            (``inf`` where a policy found no direction to borrow it from).
        selected: ``[K]`` mask of the directions to record, a tail (the others are
            the non-positive ones of a fixed-size :class:`TopK` tail).
        curvature_finite: Whether the batch's Gram matrix was finite (0-dim
            tensor; ``None`` without one): if not, the step is refused.
        damping_valid: Whether the damping policy's values are valid (0-dim tensor;
            ``None`` for policies valid by construction): if not, the step raises.
        factor: The updated averaged factor (averaged groups only).
        frozen: The coefficients of the steps until the factor's next refresh
            (:mod:`dampednewton.math.frozen_basis`; averaged groups only).
    """

    slope: Tensor
    curvature: Tensor
    selected: Tensor
    batch_curvature: Tensor | None = None
    complement_curvature: Tensor | None = None
    curvature_finite: Tensor | None = None
    damping_valid: Tensor | None = None
    factor: AveragedFactor | None = None
    frozen: FrozenBasis | None = None


class StepFinisher:
    """Finishes a group's GGN block into its :class:`GroupStep`.

    The optimizer's :class:`~dampednewton.computations.engine.GGNEngine` calls it
    after the backward pass (the complement and averaging read the full ``.grad``).
    Blocks are groups with, besides ``params``, ``criterion`` and ``damping``:
    ``newton_fraction`` (the fraction ``φ`` of the Newton coefficients),
    ``complement`` (policy or ``None``), ``averaging`` (:class:`CurvatureAveraging`
    or ``None``) and ``factor`` (the group's :class:`AveragedFactor` so far, or
    ``None``). A block whose GGN is not finite gives a step flagged in
    :attr:`GroupStep.curvature_finite` (read with the step's other checks, see
    :mod:`dampednewton._step.step_status`); one whose eigensolver fails gives ``None``
    and is recorded in :attr:`eigensolver_succeeded`. Either way the closure
    returns its loss and the optimizer refuses the step with a clear message.

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
            if block.group["averaging"] is None:
                return self._newton_step(block)
            return self._averaged_step(block)
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
        group = block.group
        gram = block.reduced_gram
        finite = finite_flag(gram.diagonal())
        directions = diagonalize(
            gram.where(finite, 0.0), as_criterion(group["criterion"])
        )
        evals, gram_evecs = directions.evals, directions.gram_evecs
        positive, lengths = directions.positive, directions.lengths
        products = slope_products(block, self.per_sample_gradients)
        gammas, lambdas = slopes_and_curvatures(block, directions, products)
        damping, valid = _damping(group["damping"], evals, gram_evecs, gammas, lambdas)
        gamma_mean, lambda_mean = gammas.mean(0), lambdas.mean(0)
        coefficients = group["newton_fraction"] * newton_coefficients(
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
        policy = as_complement(group["complement"])
        rho = None
        if policy is not None:
            mean_products = self._mean_gradient_products(block, products)
            # ũ_kᵀ Vᵀḡ = ‖V ũ_k‖ ḡᵀe_k, for the directions the step keeps.
            in_directions = (mean_products @ gram_evecs).where(positive, 0.0)
            projections = in_directions.squeeze(0) * inverse_lengths(lengths)
            gradients = _gradients(group["params"])
            energy = orthogonal_energy(_squared_norm(gradients), projections)
            # Vᵀg_⊥ = (I − ŨŨᵀ) Vᵀḡ: the batch GGN's curvature in the complement.
            residual = mean_products - in_directions @ gram_evecs.T
            measured = complement_rayleigh_quotient(residual, energy)
            # An infinite damping keeps a direction out of the policy's choice.
            rho = policy(lambda_mean, damping.where(positive, torch.inf), measured)
        if rho is None:
            beta = gram_space_step(coefficients, gram_evecs, lengths)
            return GroupStep(
                step=tuple(to_parameter_space(block, beta)),
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
            step=tuple(m - g / rho for m, g in zip(mapped, gradients, strict=True)),
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
        return mean_gradient_products(block, gradient_of)

    def _averaged_step(self, block: Block) -> GroupStep:
        """Average this batch's GGN into the group's factor, then step along it.

        A Gram matrix that is not finite is replaced by zeros and flagged in
        :attr:`GroupStep.curvature_finite`, as in :meth:`_newton_step`.
        """
        group = block.group
        averaging: CurvatureAveraging = group["averaging"]
        gram = block.reduced_gram
        finite = finite_flag(gram.diagonal())
        gram = gram.where(finite, 0.0)
        previous = group["factor"] or empty_factor(group["params"], gram)
        rank = previous.weights.numel()
        cross = gram.new_zeros(rank, gram.shape[0])
        basis_gram = gram.new_zeros(rank, rank)
        for param, basis in zip(group["params"], previous.basis, strict=True):
            if id(param) in block.factors and rank:
                cross += block.factors[id(param)].vector_products(basis)
                columns = basis.flatten(1).to(basis_gram)
                basis_gram += columns @ columns.T
        small = averaged_gram(
            basis_gram, cross.where(finite, 0.0), gram, averaging.decay
        )
        rank_kept = averaging.rank_for(as_criterion(group["criterion"]))
        weights, mixing = leading_eigenpairs(small, rank_kept)
        of_basis, of_batch = split_mixing(mixing, rank, averaging.decay)
        mapped = to_parameter_space(block, of_batch)
        basis = tuple(
            new.flatten(1).addmm_(of_basis.T.to(old), old.flatten(1)).view_as(new)
            for old, new in zip(previous.basis, mapped, strict=True)
        )
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


def empty_factor(params: Sequence[Tensor], like: Tensor) -> AveragedFactor:
    """The factor of no batch: ``r = 0`` columns.

    Args:
        params: The group's parameters.
        like: A tensor of the eigenvalues' dtype and device.

    Returns:
        An :class:`AveragedFactor` with ``updates = 0``.
    """
    basis = tuple(
        p.new_zeros(0, *p.shape, dtype=computation_dtype(p.dtype)) for p in params
    )
    return AveragedFactor(basis, like.new_zeros(0), 0)


def averaged_step(
    group: dict,
    factor: AveragedFactor,
    batch_products: Tensor | None = None,
    mean_products: Tensor | None = None,
) -> GroupStep:
    """The damped Newton (and complement) step along an averaged factor's directions.

    Directions ``u_i = B_i/√w_i`` with curvatures ``λ_i = w_i/(1 − β^t)`` (the
    bias-corrected average), slopes ``γ̄_i = ḡᵀu_i`` from the parameters' ``.grad``.
    Damping policies see ``gammas = γ̄[None]`` and ``lambdas = λ[None]`` and no Gram
    eigenvectors (``[0, K]``). The quadratic model's curvature is the average's, which
    is zero in the complement. On a refresh, this batch's ``VᵀB`` and ``Vᵀḡ`` give the
    curvature ``sᵀVVᵀs`` of the batch's GGN along the step as well.

    Args:
        group: A group with ``params``, ``criterion``, ``damping``,
            ``newton_fraction``, ``complement`` and ``averaging``.
        factor: The averaged factor (``updates >= 1``).
        batch_products: ``VᵀB`` ``[C·N, r]`` of this batch's square root, if any.
        mean_products: ``Vᵀḡ`` ``[C·N]`` (with ``batch_products``).

    Returns:
        The group's step, carrying ``factor``.
    """
    averaging: CurvatureAveraging = group["averaging"]
    all_evals = bias_corrected(factor.weights, averaging.decay, factor.updates)
    criterion = as_criterion(group["criterion"])
    start = top_k_start(criterion, all_evals.numel())
    chosen: int | Tensor = (
        selected_indices(criterion, all_evals) if start is None else start
    )
    evals = _entries(all_evals, chosen)
    weights = _entries(factor.weights, chosen)
    columns = [_entries(basis, chosen) for basis in factor.basis]
    # A fresh factor holds zero weights (and columns) where the average was not
    # positive: they get a zero coefficient.
    positive = weights > 0
    norms = weights.sqrt().where(positive, 1.0)
    gradients = _gradients(group["params"])
    projections = (
        sum(
            (c.flatten(1) @ g.flatten().to(c))
            for c, g in zip(columns, gradients, strict=True)
        )
        / norms
    )
    damping, valid = _damping(
        group["damping"],
        evals,
        evals.new_zeros(0, evals.numel()),
        projections[None],
        evals[None],
    )
    coefficients = group["newton_fraction"] * newton_coefficients(
        projections, evals, damping
    ).where(positive, 0.0)
    policy = as_complement(group["complement"])
    energy = orthogonal_energy(_squared_norm(gradients), projections)
    measured = None
    if policy is not None and batch_products is not None and mean_products is not None:
        # Vᵀg_⊥ = Vᵀḡ − Σ_i p_i Vᵀu_i: the batch GGN's curvature in the complement.
        chosen_products = _entries(batch_products.T, chosen).T
        residual = mean_products - chosen_products @ (projections / norms)
        measured = complement_rayleigh_quotient(residual, energy)
    rho = (
        None
        if policy is None
        else policy(evals, damping.where(positive, torch.inf), measured)
    )
    slope = torch.sum(projections * coefficients)
    batch_curvature = None
    if rho is None:
        weights = coefficients / norms
        step = tuple(torch.tensordot(weights.to(c), c, dims=1) for c in columns)
        if batch_products is not None:
            chosen_products = _entries(batch_products.T, chosen).T
            batch_curvature = (chosen_products @ weights).square().sum()
    else:
        rho = rho.to(evals)
        weights = complement_coefficients(coefficients, projections, rho) / norms
        step = tuple(
            torch.tensordot(weights.to(c), c, dims=1) - g / rho
            for c, g in zip(columns, gradients, strict=True)
        )
        slope = slope - energy / rho
        if batch_products is not None and mean_products is not None:
            chosen_products = _entries(batch_products.T, chosen).T
            mapped = chosen_products @ weights - mean_products / rho
            batch_curvature = mapped.square().sum()
    return GroupStep(
        step=step,
        frozen=freeze(
            factor.weights,
            all_evals,
            _spread(damping, chosen, all_evals.numel(), torch.inf),
            _spread(positive, chosen, all_evals.numel(), False),
            group["newton_fraction"],
            rho,
            _excess(slope, batch_curvature),
        ),
        evals=evals,
        gamma_mean=projections,
        lambda_mean=evals,
        damping=damping,
        coefficients=coefficients,
        slope=slope,
        curvature=torch.sum(evals * coefficients**2),
        batch_curvature=batch_curvature,
        complement_curvature=rho,
        selected=positive,
        damping_valid=valid,
        factor=factor,
    )


def _entries(tensor: Tensor, chosen: int | Tensor) -> Tensor:
    """Rows ``tensor[chosen:]`` (a top-k tail, a view) or ``tensor[chosen]``."""
    if isinstance(chosen, int):
        return tensor[chosen:]
    return tensor.index_select(0, chosen)


def _excess(slope: Tensor, batch_curvature: Tensor | None) -> Tensor:
    """``η = max(1, sᵀĜs / (−ḡᵀs))``: the batch GGN's excess over the model."""
    if batch_curvature is None:
        return torch.ones_like(slope)
    model = (-slope).clamp_min(torch.finfo(slope.dtype).tiny)
    return (batch_curvature.to(model) / model).clamp_min(1.0)


def _spread(values: Tensor, chosen: int | Tensor, size: int, fill: Any) -> Tensor:
    """``values`` of the chosen entries at their places in ``[size]``, else ``fill``."""
    spread = values.new_full((size,), fill)
    if isinstance(chosen, int):
        spread[chosen:] = values
    else:
        spread[chosen] = values
    return spread


def _damping(
    damping: Any, evals: Tensor, gram_evecs: Tensor, gammas: Tensor, lambdas: Tensor
) -> tuple[Tensor, Tensor | None]:
    """The policy's damping ``[K]`` and, unless valid by construction, its check.

    The shape is checked at once (known on the host); the values' check is a 0-dim
    tensor read with the step's other checks (see
    :mod:`dampednewton._step.step_status`).
    """
    policy = as_damping(damping)
    values = checked_damping_shape(
        policy(evals, gram_evecs, gammas, lambdas), evals.numel()
    ).to(evals)
    return values, None if trusts_its_values(policy) else valid_damping_flag(values)


def _gradients(params: Sequence[Tensor]) -> list[Tensor]:
    """The parameters' ``.grad`` in the computation dtype (zeros for frozen ones)."""
    return [
        torch.zeros_like(p, dtype=computation_dtype(p.dtype))
        if p.grad is None or not p.requires_grad
        else upcast(p.grad)
        for p in params
    ]


def _squared_norm(tensors: Sequence[Tensor]) -> Tensor:
    return cast(Tensor, sum(t.to(torch.float64).square().sum() for t in tensors))
