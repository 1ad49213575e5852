"""Directionally damped Newton steps along GGN eigenvectors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Generator, Tensor

from dampednewton.computations.block import Block, slope_products, to_parameter_space
from dampednewton.computations.directional_derivatives import slopes_and_curvatures
from dampednewton.computations.engine import GGNEngine, GGNSettings
from dampednewton.computations.interface import GGNComputation
from dampednewton.computations.selection import select_directions
from dampednewton.math.gram_space import gram_space_step, newton_coefficients
from dampednewton.policies.damping import as_damping
from dampednewton.policies.damping_values import checked_damping


@dataclass
class NewtonStep:
    """A block's damped Newton step and the quantities it was built from.

    Attributes:
        step: One tensor per parameter of the group (``p.shape``).
        evals: Selected GGN eigenvalues ``[K]``, ascending.
        gamma_mean: Mean directional gradients ``γ̄_k`` ``[K]``.
        lambda_mean: Mean directional curvatures ``λ̄_k`` ``[K]``.
        damping: Directional damping ``δ_k`` ``[K]``.
        coefficients: Step lengths ``c_k = −γ̄_k / (λ̄_k + δ_k)`` ``[K]`` (``0`` for
            eigenvalues that are not numerically positive).
    """

    step: tuple[Tensor, ...]
    evals: Tensor
    gamma_mean: Tensor
    lambda_mean: Tensor
    damping: Tensor
    coefficients: Tensor


class DirectionalDampedNewtonComputation(GGNComputation[NewtonStep]):
    r"""BackPACK extensions and hook for directionally damped Newton steps.

    With ``e_k`` the selected GGN eigenvectors, ``γ̄_k``/``λ̄_k`` the mean first/second
    directional derivatives and ``δ_k`` the damping, the step is

    .. math::

        s = \sum_k \frac{-\bar\gamma_k}{\bar\lambda_k + \delta_k} e_k = V \beta,

    formed in Gram space (``β = Σ_k c_k ũ_k/‖V ũ_k‖``) and mapped by one product.
    Groups need ``'params'``, ``'criterion'`` (callable or int ``k``) and
    ``'damping'`` (callable ``(evals, gram_evecs, gammas, lambdas) -> δ`` or a
    number). Directions whose eigenvalue is zero up to round-off or negative
    (``λ_k <= n·ε·λ_max``, selected e.g. by ViViT's keep-all criterion) get the
    coefficient ``c_k = 0`` with a warning: the step is the one restricted to the
    positive eigenvalues, and never NaN.

    The loss must use ``reduction='mean'``.
    """

    def __init__(
        self,
        subsampling_grad: Sequence[int] | None = None,
        subsampling_ggn: Sequence[int] | None = None,
        mc_samples_ggn: int = 0,
        verbose: bool = False,
        warn_small_eigvals: float = 1e-4,
        *,
        generator: Generator | None = None,
        structured: bool = True,
        per_sample_gradients: bool = True,
    ):
        """Specify the gradient and GGN approximations (none by default).

        Args:
            subsampling_grad: Samples for the directional gradients (``None``: all).
            subsampling_ggn: Samples for directions and curvatures (``None``: all).
            mc_samples_ggn: ``0`` for the exact GGN, else Monte-Carlo samples.
            verbose: Print what happens during backpropagation.
            warn_small_eigvals: Warn when a selected eigenvalue's magnitude is below.
            generator: Random source for Monte-Carlo sampling (``None``: global).
            structured: Exploit ``nn.Linear``'s Kronecker structure (``False``:
                materialize square roots and individual gradients, the reference).
            per_sample_gradients: ``False`` skips individual gradients: ``γ̄_k =
                ḡᵀ e_k`` with the batch's mean gradient ``ḡ``, read from the
                parameters' ``.grad`` after the backward pass (so gradients must be
                zero before it, as in every closure) or, for linear layers where that
                is cheaper, formed from the layer's output gradients. The damping
                policies receive ``γ̄`` as ``gammas`` (``[1, K]``). The step is formed
                in :meth:`get_result`, which must be called before the gradients
                change; ``subsampling_grad`` must be ``None``.

        Raises:
            ValueError: For ``subsampling_grad`` without per-sample gradients.
        """
        if not per_sample_gradients and subsampling_grad is not None:
            raise ValueError(
                "subsampling_grad needs per_sample_gradients=True: the mean gradient "
                "comes from .grad, which holds the whole batch."
            )
        settings = GGNSettings(
            subsampling_ggn=subsampling_ggn,
            subsampling_grad=subsampling_grad,
            mc_samples=mc_samples_ggn,
            verbose=verbose,
            warn_small_eigvals=warn_small_eigvals,
            generator=generator,
            structured=structured,
        )
        self._engine = GGNEngine(
            settings,
            self._finish,
            required_group_keys=("criterion", "damping"),
            keeps_factors=True,
            needs_gradients=per_sample_gradients,
            defers_finish=not per_sample_gradients,
        )

    @property
    def needs_gradients(self) -> bool:
        """Whether per-sample gradients are computed (``per_sample_gradients``)."""
        return self._engine.needs_gradients

    @property
    def defers_finish(self) -> bool:
        """Whether blocks are finished in :meth:`get_result` rather than in the hook.

        They are without per-sample gradients: the slopes read the complete ``.grad``.
        """
        return self._engine.defers_finish

    def _finish(self, block: Block) -> NewtonStep:
        directions = select_directions(block, self._engine.settings.warn_small_eigvals)
        evals, gram_evecs = directions.evals, directions.gram_evecs
        gammas, lambdas = slopes_and_curvatures(
            block, directions, slope_products(block, self.needs_gradients)
        )
        policy = as_damping(block.group["damping"])
        damping = checked_damping(
            policy(evals, gram_evecs, gammas, lambdas), evals.numel()
        ).to(evals)
        gamma_mean, lambda_mean = gammas.mean(0), lambdas.mean(0)
        coefficients = newton_coefficients(gamma_mean, lambda_mean, damping).where(
            directions.positive, 0.0
        )
        beta = gram_space_step(coefficients, gram_evecs, directions.lengths)
        return NewtonStep(
            step=tuple(to_parameter_space(block, beta)),
            evals=evals,
            gamma_mean=gamma_mean,
            lambda_mean=lambda_mean,
            damping=damping,
            coefficients=coefficients,
        )

    def get_result(self, group: dict) -> tuple[Tensor, ...]:
        """Return a block's damped Newton step in parameter format.

        Args:
            group: Parameter group that defines the GGN block.

        Returns:
            One tensor per parameter of ``group['params']``, shaped like it.

        Raises:
            KeyError: If there is no result for the group.
        """
        return self._result(group).step

    def get_details(self, group: dict) -> NewtonStep:
        """Return the step with its eigenvalues, slopes, curvatures and damping.

        Args:
            group: Parameter group that defines the GGN block.

        Returns:
            The block's :class:`NewtonStep`.

        Raises:
            KeyError: If there is no result for the group.
        """
        return self._result(group)
