"""``DampedNewton``, the ``torch.optim`` contract; the step is :mod:`._step`."""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from dampednewton._step.checkpoint import (
    checked_state_dict,
    restore_parameter_tensors,
    shared_defaults,
)
from dampednewton._step.closure import CLOSURE_PATTERN
from dampednewton._step.defaults import BASIS_DEFAULT, filled_defaults
from dampednewton._step.dtypes import convert_group_records
from dampednewton._step.group_checks import (
    GRAM_ONLY_OPTIONS,
    check_added_group,
    warn_ignored_options,
)
from dampednewton._step.guard import check_not_inference_mode
from dampednewton._step.options import check_nonfinite, check_process_group
from dampednewton._step.parameter_state import ParameterState
from dampednewton._step.pipeline import GLOBAL, GROUPS, Pipeline
from dampednewton._step.records import empty_group_stats
from dampednewton._step.saved_records import attach_records
from dampednewton._step.unpicklable import mark_unpicklable
from dampednewton.averaging import CurvatureAveraging
from dampednewton.backpack.seeding import SeededGenerator
from dampednewton.diagnostics import DiagnosticsMonitor
from dampednewton.policies.basis import Basis, KroneckerBasis
from dampednewton.policies.checks import check_subsampling
from dampednewton.policies.complement import ComplementPolicy
from dampednewton.policies.criteria import Criterion
from dampednewton.policies.damping import Damping
from dampednewton.policies.schedule_free import ScheduleFree
from dampednewton.process_groups import world_initialized


class DampedNewton(Optimizer):
    r"""Directionally damped Newton steps in an eigenbasis of the GGN.

    Each parameter group is one block of the generalized Gauss-Newton matrix ``G``.
    The default :class:`KroneckerBasis` approximates each layer's block by the
    Kronecker product ``S ⊗ A`` of its output and input factors (K-FAC) with
    eigenpairs ``(τ_i, u_i)`` and ``(σ_j, v_j)``; along ``e_ij = u_i ⊗ v_j`` the
    slope is ``γ_ij = u_iᵀ Ḡ v_j`` (``Ḡ`` the layer's mean gradient as a matrix),
    the curvature ``τ_i σ_j``, and the damping K-FAC's factored rule
    (``π`` balances the factors' mean eigenvalues):

    .. math::

        s &= -\sum_{ij} \frac{\gamma_{ij}}
             {(\tau_i + \sqrt{\delta}/\pi)(\sigma_j + \pi\sqrt{\delta})}
             \, e_{ij}, \\
        m &\leftarrow \mu m + \nu s, \qquad
        \theta \leftarrow (1 - \mathrm{lr}\cdot\mathrm{wd})\,\theta
            + \mathrm{lr}\cdot m, \qquad
        \nu = \min\Big(1, \sqrt{2\kappa / (-\bar g^\top s)}\Big),

    with the trust region ``ν`` (K-FAC's norm constraint, ``κ = kl_clip``, on the step
    before the learning rate, so that a learning-rate schedule scales every update), the
    momentum ``μ`` (0.5: the trust region ``κ = 10⁻³`` bounds each new ``νs``, the
    accumulated step about twice as long) and the decoupled weight decay ``wd``. The
    factors are averaged (``averaging``) and refreshed at steps 0, 1, 3, 7, 15 and then
    every ``interval`` steps; the steps in between run the closure without BackPACK's
    hooks and reuse the eigenpairs (docs/design.md). With
    ``KroneckerBasis(noise_filter=NoiseFilter())`` each kept coefficient is also scaled
    by ``ρ_ij = |m̂_ij|/√v̂_ij`` from SOAP's moments of ``γ_ij`` (opt-in). With
    ``momentum=ScheduleFree()`` (opt-in) a fast iterate ``z ← z + Δ`` takes the steps
    ``Δ``, its average is ``x ← (1 − c_t) x + c_t z`` and the parameters hold
    ``y = (1 − β) z + β x``. :class:`GramBasis` instead steps
    along the leading eigenvectors of the whole block from its Gram matrix (ViViT):
    ``s = Σ_k −φ γ̄_k/(λ̄_k + δ_k) e_k − (ḡ − Σ_k γ̄_k e_k)/ρ`` with the Newton
    fraction ``φ``, the complement curvature ``ρ`` and a trust region on
    ``max(−ḡᵀs, sᵀĜs)``.

    ``step(closure)`` runs the closure (``zero_grad``, forward, ``backward``) in a
    BackPACK context: model and loss function must be extended with
    :func:`backpack.extend`, the loss must use ``reduction='mean'``. A refused step
    (error, or a non-finite loss or step) leaves parameters and state untouched.
    Adaptive dampings (e.g. :class:`LevenbergMarquardt`) are adapted by the loss's
    reduction ratio, which calls the closure once more on the same batch.

    Example:
        >>> import torch
        >>> from backpack import extend
        >>> from dampednewton import DampedNewton
        >>> gen = torch.Generator().manual_seed(0)
        >>> model = extend(torch.nn.Linear(3, 2))
        >>> loss_fn = extend(torch.nn.CrossEntropyLoss())
        >>> x, y = torch.randn(8, 3, generator=gen), torch.tensor([0, 1] * 4)
        >>> optimizer = DampedNewton(model.parameters())
        >>> def closure():
        ...     optimizer.zero_grad()
        ...     loss = loss_fn(model(x), y)
        ...     loss.backward()
        ...     return loss
        >>> first = optimizer.step(closure)
        >>> second = optimizer.step(closure)
        >>> bool(second < first)
        True

    Options marked *basis* default to :func:`basis_defaults` of ``basis``
    (Kronecker / Gram).

    Args:
        params: Parameters or parameter groups (each group is one GGN block).
        lr: Learning rate ``>= 0`` (default: 1.0).
        damping: ``δ``: a number ``>= 0`` (constant), a damping policy
            (:mod:`dampednewton.policies`; the Kronecker basis takes constant or
            Levenberg-Marquardt), or ``None`` (*basis*: ``3e-3`` /
            ``LevenbergMarquardt(value=0.1, interval=5)``).
        criterion: Gram basis: the directions kept, an int ``k`` (the ``k`` largest
            positive eigenvalues) or a criterion policy (default: 20).
        basis: :class:`KroneckerBasis` or :class:`GramBasis` (default:
            ``KroneckerBasis()``).
        complement: Gram basis: ``ρ``, a policy (:class:`SmallestCurvature`,
            :class:`ConstantCurvature`, :class:`MeasuredCurvature`), a number
            ``> 0``, or ``None`` for no complement step (default:
            ``SmallestCurvature()``).
        newton_fraction: ``φ`` in ``(0, 1]`` (*basis*: 1.0 / 0.3).
        averaging: :class:`CurvatureAveraging` (needs a damping that uses mean
            slopes only: a number, ``ConstantDamping``, ``RelativeDamping``,
            ``LevenbergMarquardt``), or ``None`` for this batch's curvature
            (*basis*: ``CurvatureAveraging(decay=0.95, interval=15)`` /
            ``CurvatureAveraging()``).
        kl_clip: ``κ > 0`` of the trust region, or ``None`` for none (*basis*:
            1e-3 / 1.0).
        momentum: ``μ`` in ``[0, 1)``, or :class:`ScheduleFree` averaging (*basis*:
            0.5 / 0.0).
        nesterov: Nesterov's momentum, needs ``momentum > 0`` (default: False).
        weight_decay: Decoupled weight decay ``wd >= 0`` (*basis*: 1e-3 / 0.0).
        mc_samples: Monte-Carlo samples of the loss Hessian's square root, ``0``
            for the exact GGN (default: 1).
        subsampling_ggn: Sample indices of each rank's batch for the curvature,
            ``None`` for all (default: None).
        subsampling_grad: Gram basis without averaging (ViViT's step): sample
            indices for the directional gradients, ``None`` for all (default:
            None).
        warn_small_eigvals: Warn once per group when a selected direction has an
            eigenvalue below this (counted in
            ``records['groups'][i]['steps_with_small_eigenvalues']``) (default: 1e-4).
        nonfinite: ``'raise'`` a ``FloatingPointError`` on a non-finite loss or
            step, or ``'skip'`` it with a warning (default: ``'raise'``).
        seed: Seed of the Monte-Carlo generator, ``None`` to draw one from torch's
            global generator (default: None).
        monitor: Diagnostics computed in the step's backward pass (default: None).
        process_group: ``torch.distributed`` group of data parallelism
            (:mod:`dampednewton.distributed`); ``None``: the world group when more
            than one process runs, else none. Not in the state dict (default: None).

    ``mc_samples``, ``subsampling_ggn`` and ``subsampling_grad`` shape the single
    backward pass and must agree across groups; every other option can differ.
    """

    state: defaultdict[Any, Any]  # per parameter, an entry for each from the start
    records: dict[str, Any]
    """Step counters (``records['global']``) and, per group, what its last step used
    (``records['groups'][i]``: eigenvalues, damping, trust-region scale, ...)."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1.0,
        damping: float | Damping | None = None,
        criterion: int | Criterion = BASIS_DEFAULT,
        *,
        basis: Basis = KroneckerBasis(),  # noqa: B008
        complement: float | ComplementPolicy | None = BASIS_DEFAULT,
        newton_fraction: float = BASIS_DEFAULT,
        averaging: CurvatureAveraging | None = BASIS_DEFAULT,
        kl_clip: float | None = BASIS_DEFAULT,
        momentum: float | ScheduleFree = BASIS_DEFAULT,
        nesterov: bool = False,
        weight_decay: float = BASIS_DEFAULT,
        mc_samples: int = 1,
        subsampling_ggn: Sequence[int] | None = None,
        subsampling_grad: Sequence[int] | None = None,
        warn_small_eigvals: float = 1e-4,
        nonfinite: str = "raise",
        seed: int | None = None,
        monitor: DiagnosticsMonitor | None = None,
        process_group: Any = None,
    ):
        """Set the defaults of every parameter group (see the class's Args).

        Raises:
            ValueError: For invalid hyperparameters.
            TypeError: For hyperparameters of the wrong type.
        """
        given = {
            "damping": damping,
            "criterion": criterion,
            "complement": complement,
            "newton_fraction": newton_fraction,
            "averaging": averaging,
            "kl_clip": kl_clip,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
        }
        gram_options = {key: given[key] for key in GRAM_ONLY_OPTIONS}
        defaults = {
            "lr": lr,
            "basis": basis,
            **filled_defaults(basis, given),
            "mc_samples": mc_samples,
            # Read once: an iterator would be consumed by the first group.
            "subsampling_ggn": check_subsampling(subsampling_ggn, "subsampling_ggn"),
            "subsampling_grad": check_subsampling(subsampling_grad, "subsampling_grad"),
            "warn_small_eigvals": warn_small_eigvals,
        }
        self.monitor = monitor
        communicator = check_process_group(process_group, monitor)
        seeded = SeededGenerator(seed)
        if communicator is not None and seed is None:
            seeded.seed = communicator.broadcast_seed(seeded.seed)
        self._pipeline = Pipeline(
            check_nonfinite(nonfinite),
            communicator,
            seeded,
            before_init=process_group is None and not world_initialized(),
        )
        self.records = {GLOBAL: {"step": 0, "skipped_steps": 0}}
        self._constructing = True  # where add_param_group's warnings point
        super().__init__(params, defaults)
        del self._constructing
        self.state = ParameterState(dict, self.state)
        warn_ignored_options(self.param_groups[0]["basis"], gram_options)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (one GGN block) after validating its settings.

        Args:
            param_group: Group with ``'params'`` and optional hyperparameters.

        Raises:
            ValueError: For invalid hyperparameters or settings that differ from the
                existing groups' shared ones.
            TypeError: For hyperparameters of the wrong type.
        """
        given = {k: param_group[k] for k in GRAM_ONLY_OPTIONS if k in param_group}
        super().add_param_group(param_group)
        # Warnings point at the caller of add_param_group or of the constructor.
        level = 5 if getattr(self, "_constructing", False) else 3
        check_added_group(self.param_groups, self.defaults, given, level)
        if GROUPS in self.records:
            self.records[GROUPS].append(empty_group_stats())
        for param in self.param_groups[-1]["params"]:  # never empty: DCP steps those
            self.state.setdefault(param, {})

    # torch's stub overloads step as (None) -> None | (() -> float) -> float; this
    # step requires a closure and returns its Tensor loss.
    def step(  # type: ignore[override]
        self, closure: Callable[[], Tensor] | None = None
    ) -> Tensor | None:
        """Run the closure in a BackPACK context and take a damped Newton step.

        Args:
            closure: Re-evaluates the model: ``zero_grad``, forward, ``backward``,
                returns the loss. Required.

        Returns:
            The loss returned by the closure (before the update); ``None`` when it
            returned ``None`` without a backward pass (Lightning's skipped batch,
            ``training_step`` returning ``None``): no step is taken then.

        Raises:
            RuntimeError: Without a closure, inside ``torch.inference_mode()``,
                when the model or loss function is not
                extended with BackPACK, or when the closure back-propagated one
                graph twice, ran several forward passes before their backward passes
                or did not zero the gradients.
            ValueError: For invalid hyperparameters in a group, shared settings that
                differ between groups, a loss without ``reduction='mean'``, or an
                adaptive damping object that another optimizer adapts.
            TypeError: For hyperparameters of the wrong type.
            FloatingPointError: For a non-finite loss or step with
                ``nonfinite='raise'``.
        """
        if closure is None:
            raise RuntimeError(
                "DampedNewton.step needs a closure: it runs the backward pass itself, "
                f"inside a BackPACK context. Use\n{CLOSURE_PATTERN}"
            )
        check_not_inference_mode()
        return self._pipeline.step(
            closure, self.param_groups, self.state, self.records, self.monitor
        )

    @property
    def communication_seconds(self) -> float:
        """Seconds in this optimizer's collectives so far (0.0 for one process).

        Timed by :class:`~dampednewton.distributed.Communicator`; not saved.
        """
        communicator = self._pipeline.communicator
        return 0.0 if communicator is None else communicator.seconds

    @property
    def communication_bytes(self) -> float:
        """Payload bytes this rank received in collectives (0.0 for one process).

        Counted by :class:`~dampednewton.distributed.Communicator` (all-gathers:
        ``world_size - 1`` local tensors; all-reduces: a ring's ``2 (world_size -
        1) / world_size`` times the tensor); not saved.
        """
        communicator = self._pipeline.communicator
        return 0.0 if communicator is None else communicator.bytes_received

    def state_dict(self) -> dict[str, Any]:
        """Return the optimizer state, with the records and the generator's state.

        Group settings that cannot be pickled (a lambda criterion, a local damping
        function) are kept by reference, wrapped so that ``torch.save`` refuses them
        with an error naming the group and the key (see
        :class:`~dampednewton._step.unpicklable.UnpicklableSetting`).

        Returns:
            A ``torch.optim`` state dict: ``'state'`` per parameter only, so that
            ``torch.distributed.checkpoint`` takes it; each param group's extra entry
            ``'dampednewton'`` holds that group's :attr:`records` and, in group 0,
            the step counters and the seed and random state of Monte-Carlo sampling.
        """
        state = super().state_dict()
        mark_unpicklable(state["param_groups"])
        generator = self._pipeline.seeded.state_dict(self._device())
        attach_records(state, self.records, generator)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` (after validating its groups).

        Args:
            state_dict: State as returned by :meth:`state_dict`.
        """
        checked = checked_state_dict(state_dict, self.param_groups, set(self.defaults))
        shared = shared_defaults(self.defaults, self.param_groups)
        super().load_state_dict(checked.for_torch)
        # A group added later takes what group i holds now, as before the load.
        self.defaults.update({k: self.param_groups[i][k] for k, i in shared.items()})
        restore_parameter_tensors(
            self.state,
            checked.for_torch["param_groups"],
            self.param_groups,
            checked.tensors,
        )
        for group in self.param_groups:
            for param in group["params"]:
                self.state.setdefault(param, {})
        # Copied: this optimizer's counters are not shared with the source's.
        self.records = copy.deepcopy(checked.records)
        convert_group_records(self.param_groups, self.records.get(GROUPS, ()))
        self._pipeline.clear()
        if checked.generator is not None:
            self._pipeline.seeded.load_state_dict(checked.generator, self._device())

    def __getstate__(self) -> dict[str, Any]:
        """``torch.optim``'s pickled state and what rebuilds the step's machinery.

        A copy (``copy.deepcopy``, ``pickle``) steps as the original, in the default
        process group, without a monitor (a monitor watches its own parameters).
        """
        pipeline = self._pipeline
        generator = pipeline.seeded.state_dict(self._device())
        machinery = {"nonfinite": pipeline.nonfinite, "generator": generator}
        return {
            **super().__getstate__(),
            "records": self.records,
            "pipeline": machinery,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a copy (``load_state_dict`` passes no machinery: it stays)."""
        state = dict(state)
        pipeline = state.pop("pipeline", None)
        super().__setstate__(state)
        self.state = ParameterState(dict, self.state)  # torch's load makes a plain one
        # torch adds it for its own optimizers; groups added later would carry it.
        self.defaults.pop("differentiable", None)
        if pipeline is None:
            return
        self.monitor = None
        seeded = SeededGenerator(pipeline["generator"]["seed"])
        seeded.load_state_dict(pipeline["generator"], self._device())
        communicator = check_process_group(None, self.monitor)
        self._pipeline = Pipeline(
            pipeline["nonfinite"], communicator, seeded, not world_initialized()
        )

    def _device(self) -> torch.device:
        return self.param_groups[0]["params"][0].device
