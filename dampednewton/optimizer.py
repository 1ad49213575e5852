"""``DampedNewton``, the ``torch.optim`` contract; the step is :mod:`._step`."""

from __future__ import annotations

import copy
import functools
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Generator, Tensor
from torch.optim import Optimizer

from dampednewton._step.adaptation import adapt, distinct_adaptive
from dampednewton._step.amortized import (
    FrozenBases,
    gradient_vector,
    record_step_lengths,
    stored_frozen,
    trust_bound,
)
from dampednewton._step.checkpoint import (
    check_state_dict,
    mark_unpicklable,
    unwrap_settings,
)
from dampednewton._step.guard import (
    STACKLEVEL_OF_CALLER,
    GeneratorSnapshot,
    check_loss_type,
    nonfinite_problem,
    refuse,
)
from dampednewton._step.options import (
    GroupOptions,
    SharedOptions,
    ValidatedGroups,
    check_known_keys,
    check_nonfinite,
    check_process_group,
)
from dampednewton._step.records import (
    FROZEN,
    StepRecorder,
    empty_group_stats,
    store_factors,
)
from dampednewton._step.seeding import SeededGenerator
from dampednewton._step.step_pass import CLOSURE_PATTERN, StepPass, run_closure
from dampednewton._step.step_status import read_status, settled
from dampednewton._step.update import apply_flat_step, apply_steps
from dampednewton.averaging import CurvatureAveraging
from dampednewton.backpack.extensions import modified_loss_warning
from dampednewton.diagnostics import DiagnosticsMonitor
from dampednewton.math.frozen_basis import frozen_basis_step, trust_scale_on_host
from dampednewton.policies.complement import ComplementPolicy, SmallestCurvature
from dampednewton.policies.criteria import Criterion
from dampednewton.policies.damping import Damping, LevenbergMarquardt

GLOBAL = "global"
GROUPS = "groups"
REFRESH_DUE = "refresh_due"
"""Global state: the next step refreshes every averaged group (the loss rose)."""
REFRESH_LOSS = "refresh_loss"
"""Global state: the mini-batch loss of the last refresh."""


DEFAULT_DAMPING = 0.1
"""Initial ``δ`` of the default Levenberg-Marquardt damping."""
DEFAULT_DAMPING_INTERVAL = 5
"""Steps between adaptations of the default Levenberg-Marquardt damping (K-FAC's T₃)."""


def _loss_tolerance(options: Sequence[GroupOptions]) -> float | None:
    """The smallest ``loss_tolerance`` of the averaged groups (``None``: none set)."""
    tolerances = [
        option.averaging.loss_tolerance
        for option in options
        if option.averaging is not None and option.averaging.loss_tolerance is not None
    ]
    return min(tolerances, default=None)


class DampedNewton(Optimizer):
    r"""Directionally damped Newton steps along the GGN's leading eigenvectors.

    Each parameter group is one block of the generalized Gauss-Newton matrix
    ``G = V Vᵀ``. Per group, the criterion selects eigenvectors ``e_k`` of ``G`` (from
    the small Gram matrix ``VᵀV``, or of the averaged GGN, see below). With the mean
    directional slopes ``γ̄_k = ḡᵀ e_k``, curvatures ``λ̄_k = e_kᵀ G e_k`` and the damping
    ``δ_k`` of the group's damping policy, the direction is

    .. math::

        s = \sum_k \frac{-\varphi\,\bar\gamma_k}{\bar\lambda_k + \delta_k} e_k
            - \frac{1}{\rho}\Big(\bar g - \sum_k \bar\gamma_k e_k\Big),

    the first term being the fraction ``φ`` (``newton_fraction``) of the damped
    Newton step along the kept directions, the second the complement step along the
    rest of the mean gradient ``ḡ`` with curvature ``ρ`` (default: the smallest kept
    ``λ̄_k + δ_k``; ``complement=None`` drops it; with ``φ = 1`` as well this is
    ViViT's step). The update
    ``θ ← (1 − lr·wd) θ + lr·m`` with ``m ← μm + νs`` (:mod:`dampednewton._step.update`)
    has a trust region ``ν = min(1, √(2κ / (lr² max(−ḡᵀs, sᵀĜs))))`` on the damped
    quadratic model and this batch's GGN ``Ĝ`` (K-FAC's norm constraint,
    ``κ = kl_clip``), the momentum ``μ`` and a decoupled weight decay ``wd``.

    With ``averaging=CurvatureAveraging(decay=β, rank=r)`` a group's directions are
    those of the GGN averaged across steps, ``Ḡ_t = β Ḡ_{t−1} + (1 − β) V Vᵀ``, kept
    as a rank-``r`` factor and bias-corrected by ``1 − β^t``; between refreshes
    (``interval``) the closure runs without BackPACK extensions.

    ``step(closure)`` runs the closure (``zero_grad``, forward, ``backward``) inside a
    BackPACK context, so model and loss function must be extended with
    :func:`backpack.extend` and the loss must use ``reduction='mean'``. All groups'
    steps are computed before any parameter moves; a refused step (error, or a
    non-finite loss or step) leaves parameters and optimizer state untouched.

    Adaptive damping policies (:class:`~dampednewton.policies.AdaptiveDamping`, e.g.
    :class:`LevenbergMarquardt`) are adapted once per policy object after each step
    by the reduction ratio of the loss, which calls the closure a second time
    (outside the BackPACK context) on the same batch.

    Every hyperparameter lives in the param groups. ``mc_samples``, ``subsampling_ggn``
    and ``subsampling_grad`` shape the single backward pass and must agree across
    groups.

    Example:
        >>> import torch
        >>> from backpack import extend
        >>> from dampednewton import DampedNewton
        >>> gen = torch.Generator().manual_seed(0)
        >>> model = extend(torch.nn.Linear(3, 2))
        >>> loss_fn = extend(torch.nn.CrossEntropyLoss())
        >>> x, y = torch.randn(8, 3, generator=gen), torch.tensor([0, 1] * 4)
        >>> optimizer = DampedNewton(model.parameters(), damping=0.1, criterion=4)
        >>> def closure():
        ...     optimizer.zero_grad()
        ...     loss = loss_fn(model(x), y)
        ...     loss.backward()
        ...     return loss
        >>> first = optimizer.step(closure)
        >>> second = optimizer.step(closure)
        >>> bool(second < first)
        True
    """

    # Per parameter as in torch.optim, plus the entries GLOBAL and GROUPS.
    state: defaultdict[Any, Any]

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1.0,
        damping: float | Damping | None = None,
        criterion: int | Criterion = 20,
        *,
        complement: float | ComplementPolicy | None = SmallestCurvature(),  # noqa: B008
        newton_fraction: float = 0.3,
        averaging: CurvatureAveraging | None = CurvatureAveraging(),  # noqa: B008
        kl_clip: float | None = 1.0,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        mc_samples: int = 1,
        subsampling_ggn: Sequence[int] | None = None,
        subsampling_grad: Sequence[int] | None = None,
        warn_small_eigvals: float = 1e-4,
        nonfinite: str = "raise",
        seed: int | None = None,
        monitor: DiagnosticsMonitor | None = None,
        process_group: Any = None,
    ):
        """Set the defaults of every parameter group.

        Args:
            params: Parameters or parameter groups (each group is one GGN block).
            lr: Learning rate (>= 0) multiplying the damped Newton step.
            damping: Number >= 0 (constant damping), a damping policy
                ``(evals, gram_evecs, gammas, lambdas) -> δ``, or ``None`` (the
                default) for a new ``LevenbergMarquardt(value=0.1, interval=5)``:
                ``δ`` adapted by the reduction ratio from 0.1 every 5 steps, which
                call the closure once more; shared by the groups that do not set
                their own.
            criterion: Int ``k`` (the ``k`` largest positive eigenvalues) or a
                callable mapping ascending eigenvalues to indices.
            complement: Curvature ``ρ`` of the complement step: a policy
                (:class:`SmallestCurvature`, :class:`ConstantCurvature`), a number
                ``ρ > 0``, or ``None`` for ViViT's step inside the directions only.
            newton_fraction: Fraction ``φ`` in ``(0, 1]`` of the damped Newton
                step taken along the kept directions (``1``: the whole step, as
                ViViT). Along a stiff direction a whole Newton step carries the
                full gradient noise of the batch; see the README for the evidence
                behind the default.
            averaging: :class:`CurvatureAveraging` to average the GGN across steps
                (needs a damping policy from mean slopes: constant or
                Levenberg-Marquardt), or ``None`` for this batch's GGN.
            kl_clip: Trust region ``κ > 0`` on the damped quadratic model,
                ``½ lr² ν² (−ḡᵀs) ≤ κ``, or ``None``.
            momentum: Heavy-ball momentum ``μ`` in ``[0, 1)`` on the (clipped) steps.
            nesterov: Nesterov's variant of the momentum (needs ``momentum > 0``).
            weight_decay: Decoupled weight decay (``θ ← (1 − lr·wd) θ``), ``>= 0``.
            mc_samples: ``0`` for the exact GGN, else Monte-Carlo samples of the loss
                Hessian's square root (``1`` replaces ``C`` by 1 in the costs).
            subsampling_ggn: Sample indices for directions and curvatures (under
                data parallelism: of each rank's local batch).
            subsampling_grad: Sample indices for the directional gradients
                (likewise local).
            warn_small_eigvals: Warn (once per group) when a direction of this
                batch's GGN is selected with an eigenvalue below this; such steps
                are counted in ``state['groups'][i]['steps_with_small_eigenvalues']``.
            nonfinite: ``'raise'`` a ``FloatingPointError`` on a non-finite loss or
                step, or ``'skip'`` the update with a warning (counted in the state).
            seed: Seed of the optimizer's own generator for Monte-Carlo sampling;
                ``None`` draws one from torch's global generator.
            monitor: Diagnostics computed in the same backward pass as the step, on
                their schedules; each record also gets the step's eigenvalues,
                damping and number of directions per group (``newton/...`` keys).
            process_group: ``torch.distributed`` group of data parallelism
                (:mod:`dampednewton.distributed`); ``None``: the world group when
                ``torch.distributed`` is initialized with more than one process,
                else a single process. Not part of the state dict.

        Raises:
            ValueError: For invalid hyperparameters.
        """
        if damping is None:
            damping = LevenbergMarquardt(
                value=DEFAULT_DAMPING, interval=DEFAULT_DAMPING_INTERVAL
            )
        defaults = {
            "lr": lr,
            "damping": damping,
            "criterion": criterion,
            "complement": complement,
            "newton_fraction": newton_fraction,
            "averaging": averaging,
            "kl_clip": kl_clip,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "mc_samples": mc_samples,
            "subsampling_ggn": subsampling_ggn,
            "subsampling_grad": subsampling_grad,
            "warn_small_eigvals": warn_small_eigvals,
        }
        self._nonfinite = check_nonfinite(nonfinite)
        self.monitor = monitor
        self._communicator = check_process_group(process_group, monitor)
        self._seeded = SeededGenerator(seed)
        if self._communicator is not None and seed is None:
            self._seeded.seed = self._communicator.broadcast_seed(self._seeded.seed)
        self._pass = StepPass()
        self._bases = FrozenBases()
        self._validated = ValidatedGroups()
        self._recorder = StepRecorder()
        super().__init__(params, defaults)
        self.state[GLOBAL] = {"step": 0, "skipped_steps": 0}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (one GGN block) after validating its settings.

        Args:
            param_group: Group with ``'params'`` and optional hyperparameters.

        Raises:
            ValueError: For invalid hyperparameters or settings that differ from the
                existing groups' shared ones.
            TypeError: For hyperparameters of the wrong type.
        """
        check_known_keys(param_group, self.defaults)
        super().add_param_group(param_group)
        try:
            GroupOptions.from_group(self.param_groups[-1])
            SharedOptions.from_groups(self.param_groups)
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise
        if GROUPS in self.state:
            self.state[GROUPS].append(empty_group_stats())

    # torch's stub overloads step as (None) -> None | (() -> float) -> float; this
    # step requires a closure and returns its Tensor loss.
    def step(  # type: ignore[override]
        self, closure: Callable[[], Tensor] | None = None
    ) -> Tensor:
        """Run the closure in a BackPACK context and take a damped Newton step.

        Args:
            closure: Re-evaluates the model: ``zero_grad``, forward, ``backward``,
                returns the loss. Required.

        Returns:
            The loss returned by the closure (before the update).

        Raises:
            RuntimeError: Without a closure, when the model or loss function is not
                extended with BackPACK, or when the closure ran several backward
                passes or did not zero the gradients.
            ValueError: For invalid hyperparameters in a group, shared settings that
                differ between groups, or a loss without ``reduction='mean'``.
            TypeError: For hyperparameters of the wrong type.
            FloatingPointError: For a non-finite loss or step with
                ``nonfinite='raise'``.
        """
        if closure is None:
            raise RuntimeError(
                "DampedNewton.step needs a closure: it runs the backward pass itself, "
                f"inside a BackPACK context. Use\n{CLOSURE_PATTERN}"
            )
        options, shared = self._validated.get(self.param_groups)
        step_index = self.state[GLOBAL]["step"]
        if self._between_refreshes(options, step_index):
            return self._frozen_step(closure, options)
        generator = self._mc_generator()
        with GeneratorSnapshot(generator) as snapshot:
            monitor = self._active_monitor(step_index)
            loss, results, solved, deferred = self._pass.run(
                closure,
                self.param_groups,
                options,
                shared,
                self.state,
                generator=generator,
                monitor=monitor,
                step=step_index,
                communicator=self._communicator,
                refresh=self.state[GLOBAL].get(REFRESH_DUE, False),
            )
            check_loss_type(loss)
            thresholds = [option.warn_small_eigvals for option in options]
            status = read_status(loss, results, thresholds, deferred)
            status.check_inputs(results, deferred)
            if not status.loss_unscaled:
                warnings.warn(
                    modified_loss_warning(
                        deferred.loss_name, len(deferred.loss_weights)
                    ),
                    stacklevel=STACKLEVEL_OF_CALLER - 1,
                )
            problem = nonfinite_problem(loss, status, solved)
            if self._communicator is not None:
                refused = self._communicator.any_refuses(problem is not None)
                if refused and problem is None:
                    problem = "another rank refused the step"
            if problem is not None:
                snapshot.restore()
                refuse(problem, self._nonfinite)
                self.state[GLOBAL]["skipped_steps"] += 1
                return loss
            record = None
            if monitor is not None:
                params = [p for group in self.param_groups for p in group["params"]]
                record = monitor.finish(step_index, params, loss)
        results = [
            settled(result, group)
            for result, group in zip(results, status.groups, strict=True)
        ]
        scales = apply_steps(
            [group["params"] for group in self.param_groups],
            options,
            results,
            self.state,
        )
        store_factors(self.state, self._group_stats(), self.param_groups, results)
        if any(result is not None and result.factor for result in results):
            record_step_lengths(self._group_stats(), results, scales)
            self._bases.clear()
            self.state[GLOBAL].update({REFRESH_DUE: False, REFRESH_LOSS: loss.detach()})
        self.state[GLOBAL]["step"] += 1
        self._recorder.record(
            self._group_stats(),
            thresholds,
            [
                0 if group is None else group.small_eigenvalues
                for group in status.groups
            ],
            results,
            scales,
            record,
        )
        adaptive = distinct_adaptive(option.damping for option in options)
        if adaptive:
            multiples = [o.lr * scale for o, scale in zip(options, scales, strict=True)]
            self.state[GLOBAL]["reduction_ratio"] = adapt(
                adaptive,
                closure,
                loss,
                zip(multiples, results, strict=True),
                mean_over_ranks=None
                if self._communicator is None
                else self._communicator.mean,
            )
        return loss

    def _between_refreshes(self, options: Sequence[GroupOptions], step: int) -> bool:
        """Whether every group steps along its frozen basis (the lean path).

        Groups with a diagnostics monitor active or under data parallelism take the
        same step through the general pipeline.
        """
        stats = self.state.get(GROUPS)
        if not stats or self._communicator is not None:
            return False
        if self.state[GLOBAL].get(REFRESH_DUE, False):
            return False
        if self._active_monitor(step) is not None:
            return False
        return all(
            option.averaging is not None
            and FROZEN in group
            and not option.averaging.refreshes(step, group["curvature_updates"])
            for option, group in zip(options, stats, strict=True)
        )

    def _frozen_step(
        self, closure: Callable[[], Tensor], options: Sequence[GroupOptions]
    ) -> Tensor:
        """A step between refreshes: plain backward pass, steps along frozen bases.

        One host read (whether loss and steps are finite); a refused step leaves
        parameters and state untouched.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        loss = run_closure(closure, params, [], [], self._pass.extended_modules)
        check_loss_type(loss)
        with torch.no_grad():
            steps, frozens = [], []
            for index, group in enumerate(self.param_groups):
                basis = self._bases.get(index, self.state, group["params"])
                frozen = stored_frozen(self.state[GROUPS][index])
                assert frozen is not None  # checked by _between_refreshes
                gradient = gradient_vector(group["params"], basis)
                steps.append(frozen_basis_step(basis, gradient, frozen))
                frozens.append(frozen)
            # One read: the loss (and the last refresh's), each step's slope and
            # squared length, and its frozen excess and length. A non-finite loss,
            # gradient or step makes a read value non-finite.
            reference = self.state[GLOBAL].get(REFRESH_LOSS)
            read = [loss.detach(), loss.detach() if reference is None else reference]
            for step, frozen in zip(steps, frozens, strict=True):
                read += [
                    step.slope,
                    step.step.square().sum(),
                    frozen.curvature_excess,
                    frozen.step_length,
                ]
            dtype = functools.reduce(torch.promote_types, (t.dtype for t in read))
            values = torch.stack([t.to(dtype) for t in read]).tolist()
            if not all(math.isfinite(value) for value in values[:2] + values[2::4]):
                refuse("the loss or the step is not finite", self._nonfinite)
                self.state[GLOBAL]["skipped_steps"] += 1
                return loss
            tolerance = _loss_tolerance(options)
            if tolerance is not None and values[0] > (1 + tolerance) * values[1]:
                self.state[GLOBAL][REFRESH_DUE] = True
            for index, (group, option, step) in enumerate(
                zip(self.param_groups, options, steps, strict=True)
            ):
                slope, squares, excess, length = values[2 + 4 * index : 6 + 4 * index]
                bound = trust_bound(option.lr, option.kl_clip)
                scale = trust_scale_on_host(slope, squares, excess, length, bound)
                apply_flat_step(group["params"], step.step, self.state, option, scale)
        self.state[GLOBAL]["step"] += 1
        return loss

    @property
    def communication_seconds(self) -> float:
        """Wall-clock seconds spent in ``torch.distributed`` collectives so far.

        The time of every collective of this optimizer (see
        :class:`~dampednewton.distributed.Communicator`); ``0.0`` for one process.
        Not part of the state dict.
        """
        return 0.0 if self._communicator is None else self._communicator.seconds

    @property
    def communication_bytes(self) -> float:
        """Payload bytes this rank received in ``torch.distributed`` collectives.

        Counted by :class:`~dampednewton.distributed.Communicator` (all-gathers:
        ``world_size - 1`` local tensors; all-reduces: a ring's
        ``2 (world_size - 1) / world_size`` times the tensor); ``0.0`` for one
        process. Not part of the state dict.
        """
        return 0.0 if self._communicator is None else self._communicator.bytes_received

    def _group_stats(self) -> list[dict[str, Any]]:
        return self.state.setdefault(
            GROUPS, [empty_group_stats() for _ in self.param_groups]
        )

    def state_dict(self) -> dict[str, Any]:
        """Return the optimizer state, including the Monte-Carlo generator's state.

        Group settings that cannot be pickled (a lambda criterion, a local damping
        function) are kept by reference, wrapped so that ``torch.save`` refuses them
        with an error naming the group and the key (see
        :class:`~dampednewton._step.checkpoint.UnpicklableSetting`).

        Returns:
            A ``torch.optim`` state dict; the extra entry ``'generator'`` holds the
            random state of Monte-Carlo sampling.
        """
        state = super().state_dict()
        mark_unpicklable(state["param_groups"])
        state["dampednewton"] = self._seeded.state_dict(self._device())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` (after validating its groups).

        Args:
            state_dict: State as returned by :meth:`state_dict`.
        """
        check_state_dict(state_dict, self.param_groups)
        state_dict = dict(state_dict)
        extra = state_dict.pop("dampednewton", None)
        state_dict["param_groups"] = unwrap_settings(state_dict["param_groups"])
        for group in state_dict["param_groups"]:
            GroupOptions.from_group(group)
        super().load_state_dict(state_dict)
        # torch.optim keeps entries that are not per-parameter by reference: copy them,
        # so that this optimizer's counters are not shared with the source's.
        for key in (GLOBAL, GROUPS):
            if key in self.state:
                self.state[key] = copy.deepcopy(self.state[key])
        self._pass.clear()
        self._bases.clear()
        if extra is not None:
            self._seeded.load_state_dict(extra, self._device())

    def _mc_generator(self) -> Generator | None:
        """The Monte-Carlo generator, ``None`` for the exact GGN."""
        if self.param_groups[0]["mc_samples"] == 0:
            return None
        if self._communicator is not None:
            return self._seeded.for_rank(
                self._device(), self._communicator.rank, self.state[GLOBAL]["step"]
            )
        return self._seeded.get(self._device())

    def _active_monitor(self, step: int) -> DiagnosticsMonitor | None:
        """The monitor if it computes diagnostics at ``step``."""
        active = self.monitor is not None and self.monitor.is_active(step)
        return self.monitor if active else None

    def _device(self) -> torch.device:
        return self.param_groups[0]["params"][0].device
