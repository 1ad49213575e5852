"""``DampedNewton``: a ``torch.optim`` optimizer of damped Newton steps."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from backpack import backpack
from torch import Generator, Tensor
from torch.optim import Optimizer

from dampednewton.averaging import CurvatureAveraging
from dampednewton.backward import SingleBackwardCheck, quiet_backward_hook_warning
from dampednewton.checkpoint import mark_unpicklable, unwrap_settings
from dampednewton.complement import ComplementPolicy, SmallestCurvature, as_complement
from dampednewton.computations.base import GRAD_BATCH
from dampednewton.computations.extensions import (
    IndividualGradients,
    NonFiniteModelOutput,
)
from dampednewton.computations.groups import validate_subsampling
from dampednewton.criteria import Criterion, as_criterion
from dampednewton.damping import Damping, as_damping
from dampednewton.diagnostics import DiagnosticsMonitor
from dampednewton.finite import all_finite
from dampednewton.group_step import (
    AveragedFactor,
    GroupStep,
    StepComputation,
    averaged_step,
)
from dampednewton.model import predicted_change, trust_region_scale, validate_kl_clip

CLOSURE_PATTERN = """\
    def closure():
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss

    loss = optimizer.step(closure)"""

SHARED_SETTINGS = ("mc_samples", "subsampling_ggn", "subsampling_grad")
# Keys a group may carry besides the hyperparameters: a label, and LR schedulers' own.
EXTRA_GROUP_KEYS = ("name", "initial_lr")
GLOBAL = "global"
# Warnings of step()'s helpers point at the user's call: helper, step, and the
# profiling wrapper that torch.optim puts around every optimizer's step.
STACKLEVEL_OF_CALLER = 4
GROUPS = "groups"
BASIS = "curvature_basis"
MOMENTUM = "momentum_buffer"


class DampedNewton(Optimizer):
    r"""Directionally damped Newton steps along the GGN's leading eigenvectors.

    Each parameter group is one block of the generalized Gauss-Newton matrix
    ``G = V Vᵀ``. Per group, the criterion selects eigenvectors ``e_k`` of ``G`` (from
    the small Gram matrix ``VᵀV``, or of the averaged GGN, see below). With the mean
    directional slopes ``γ̄_k = ḡᵀ e_k``, curvatures ``λ̄_k = e_kᵀ G e_k`` and the damping
    ``δ_k`` of the group's damping policy, the direction is

    .. math::

        s = \sum_k \frac{-\bar\gamma_k}{\bar\lambda_k + \delta_k} e_k
            - \frac{1}{\rho}\Big(\bar g - \sum_k \bar\gamma_k e_k\Big),

    the second term being the complement step along the rest of the mean gradient
    ``ḡ`` with curvature ``ρ`` (default: the smallest kept ``λ̄_k + δ_k``;
    ``complement=None`` drops it, which is ViViT's step). The update is

    .. math::

        \nu = \min\Big(1, \sqrt{\frac{2\kappa}{\mathrm{lr}^2
            \max(-\bar g^\top s,\; s^\top \hat G s)}}\Big), \quad
        m \leftarrow \mu m + \nu s, \quad
        \theta \leftarrow (1 - \mathrm{lr}\cdot\mathrm{wd})\,\theta
            + \mathrm{lr}\cdot m

    (Nesterov: ``θ += lr·(νs + μm)``): ``ν`` is a trust region on the damped quadratic
    model and this batch's GGN ``Ĝ`` (K-FAC's norm constraint, ``κ = kl_clip``), ``μ``
    the momentum and ``wd`` a decoupled weight decay.

    With ``averaging=CurvatureAveraging(decay=β, rank=r)`` a group's directions are
    those of the GGN averaged across steps, ``Ḡ_t = β Ḡ_{t−1} + (1 − β) V Vᵀ``, kept
    as a rank-``r`` factor and bias-corrected by ``1 − β^t``; between refreshes
    (``interval``) the closure runs without BackPACK extensions.

    ``step(closure)`` runs the closure (``zero_grad``, forward, ``backward``) inside a
    BackPACK context, so model and loss function must be extended with
    :func:`backpack.extend` and the loss must use ``reduction='mean'``. All groups'
    steps are computed before any parameter moves; a refused step (error, or a
    non-finite loss or step) leaves parameters and optimizer state untouched.

    Damping policies with an ``update`` method (:class:`LevenbergMarquardt`) are
    adapted after each step by the reduction ratio of the loss, which calls the
    closure a second time (outside the BackPACK context) on the same batch.

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

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1.0,
        damping: float | Damping = 0.1,
        criterion: int | Criterion = 20,
        *,
        complement: float | ComplementPolicy | None = SmallestCurvature(),  # noqa: B008
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
    ):
        """Set the defaults of every parameter group.

        Args:
            params: Parameters or parameter groups (each group is one GGN block).
            lr: Learning rate (>= 0) multiplying the damped Newton step.
            damping: Number >= 0 (constant damping) or a damping policy
                ``(evals, gram_evecs, gammas, lambdas) -> δ``.
            criterion: Int ``k`` (the ``k`` largest positive eigenvalues) or a
                callable mapping ascending eigenvalues to indices.
            complement: Curvature ``ρ`` of the complement step: a policy
                (:class:`SmallestCurvature`, :class:`ConstantCurvature`), a number
                ``ρ > 0``, or ``None`` for ViViT's step inside the directions only.
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
            subsampling_ggn: Sample indices for directions and curvatures.
            subsampling_grad: Sample indices for the directional gradients.
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

        Raises:
            ValueError: For invalid hyperparameters.
        """
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}.")
        defaults = {
            "lr": lr,
            "damping": damping,
            "criterion": criterion,
            "complement": complement,
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
        self._nonfinite = nonfinite
        self.monitor = monitor
        self._seed = (
            int(torch.randint(2**62, (1,)).item()) if seed is None else int(seed)
        )
        self._generator: Generator | None = None
        self._cached: tuple[tuple, StepComputation, list] | None = None
        self._warned_no_direction: set[int] = set()
        self._warned_small_eigenvalues: set[int] = set()
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
        unknown = set(param_group) - {"params", *self.defaults, *EXTRA_GROUP_KEYS}
        if unknown:
            raise ValueError(
                f"Unknown hyperparameters {sorted(unknown)} in parameter group; "
                f"DampedNewton knows {sorted(self.defaults)}."
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _validate_group(group)
            _check_shared_settings(self.param_groups)
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise
        if GROUPS in self.state:
            self.state[GROUPS].append(_empty_group_stats())

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor:
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
            FloatingPointError: For a non-finite loss or step with
                ``nonfinite='raise'``.
        """
        if closure is None:
            raise RuntimeError(
                "DampedNewton.step needs a closure: it runs the backward pass itself, "
                f"inside a BackPACK context. Use\n{CLOSURE_PATTERN}"
            )
        for group in self.param_groups:
            _validate_group(group)
        _check_shared_settings(self.param_groups)
        step_index = self.state[GLOBAL]["step"]
        blocks = [
            self._block(index, group) for index, group in enumerate(self.param_groups)
        ]
        refreshing = [
            block["averaging"] is None
            or block["averaging"].refreshes(step_index, _updates(block["factor"]))
            for block in blocks
        ]
        generator = self._mc_generator()
        generator_state = None if generator is None else generator.get_state()
        try:
            computation, extensions, hook = None, [], None
            if any(refreshing):
                computation, extensions = self._computation_and_extensions(generator)
                hook = computation.get_extension_hook(
                    [
                        b
                        for b, refresh in zip(blocks, refreshing, strict=True)
                        if refresh
                    ]
                )
            extensions, hook = self._with_diagnostics(extensions, hook, step_index)
            params = [p for group in self.param_groups for p in group["params"]]
            try:
                with (
                    torch.enable_grad(),
                    quiet_backward_hook_warning(),
                    SingleBackwardCheck(params) as backward_check,
                ):
                    if extensions:
                        with backpack(*extensions, extension_hook=hook):
                            loss = closure()
                    else:
                        loss = closure()
                _refuse_bad_backward(backward_check)
                with torch.no_grad():
                    results = [
                        self._result(computation, block)
                        if refresh
                        else averaged_step(block, block["factor"])
                        for block, refresh in zip(blocks, refreshing, strict=True)
                    ]
            except NonFiniteModelOutput:
                # Raised inside backward, before the closure could return its loss.
                loss, results = torch.tensor(math.nan), [None] * len(blocks)
            curvature_finite = computation is None or computation.curvature_finite
            if self._refuse_nonfinite(loss, results, curvature_finite):
                if generator is not None:
                    generator.set_state(generator_state)
                return loss
            record = self._finish_diagnostics(step_index, loss)
        except BaseException:
            if generator is not None:
                generator.set_state(generator_state)
            raise
        scales = self._apply(results)
        self._record(results, scales, record)
        self._adapt_damping(closure, loss, results, scales)
        return loss

    def _block(self, index: int, group: dict[str, Any]) -> dict[str, Any]:
        """The group as the step computation sees it, with its averaged factor."""
        return {
            "params": group["params"],
            "criterion": group["criterion"],
            "damping": group["damping"],
            "complement": group["complement"],
            "averaging": group["averaging"],
            "factor": self._stored_factor(index, group),
        }

    def _stored_factor(
        self, index: int, group: dict[str, Any]
    ) -> AveragedFactor | None:
        """The group's averaged factor from the optimizer state (``None`` if none)."""
        stats = self.state.get(GROUPS, [])
        updates = stats[index].get("curvature_updates", 0) if stats else 0
        if group["averaging"] is None or updates == 0:
            return None
        basis = tuple(self.state[p][BASIS] for p in group["params"])
        return AveragedFactor(basis, stats[index]["curvature_weights"], updates)

    def _apply(self, results: list[GroupStep | None]) -> list[Tensor | float]:
        """Move the parameters: trust region, momentum, weight decay, commit factors.

        Returns:
            The trust-region scale ``ν`` of every group (1 for groups without a step).
        """
        scales: list[Tensor | float] = []
        with torch.no_grad():
            for group, result in zip(self.param_groups, results, strict=True):
                if result is None:
                    scales.append(1.0)
                    continue
                lr, mu = group["lr"], group["momentum"]
                scale = trust_region_scale(
                    lr, result.slope, result.batch_curvature, group["kl_clip"]
                )
                scales.append(scale)
                for param, direction in zip(group["params"], result.step, strict=True):
                    if not param.requires_grad:
                        continue
                    update = (direction * scale).to(param.dtype)
                    if mu > 0:
                        buffer = self.state[param].get(MOMENTUM)
                        if buffer is None:
                            buffer = self.state[param][MOMENTUM] = update.clone()
                        else:
                            buffer.mul_(mu).add_(update)
                        update = (
                            update.add(buffer, alpha=mu)
                            if group["nesterov"]
                            else buffer
                        )
                    if group["weight_decay"] > 0:
                        param.mul_(1 - lr * group["weight_decay"])
                    param.add_(update, alpha=lr)
                if result.factor is not None:
                    self._store_factor(group, result.factor)
        return scales

    def _store_factor(self, group: dict[str, Any], factor: AveragedFactor) -> None:
        index = self.param_groups.index(group)
        for param, basis in zip(group["params"], factor.basis, strict=True):
            self.state[param][BASIS] = basis
        stats = self._group_stats()[index]
        stats.update(curvature_weights=factor.weights, curvature_updates=factor.updates)

    def _group_stats(self) -> list[dict[str, Any]]:
        return self.state.setdefault(
            GROUPS, [_empty_group_stats() for _ in self.param_groups]
        )

    def state_dict(self) -> dict[str, Any]:
        """Return the optimizer state, including the Monte-Carlo generator's state.

        Group settings that cannot be pickled (a lambda criterion, a local damping
        function) are kept by reference, wrapped so that ``torch.save`` refuses them
        with an error naming the group and the key (see
        :class:`~dampednewton.checkpoint.UnpicklableSetting`).

        Returns:
            A ``torch.optim`` state dict; the extra entry ``'generator'`` holds the
            random state of Monte-Carlo sampling.
        """
        state = super().state_dict()
        mark_unpicklable(state["param_groups"])
        generator = self._mc_generator(create=True)
        state["dampednewton"] = {
            "seed": self._seed,
            "generator": None if generator is None else generator.get_state(),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` (after validating its groups).

        Args:
            state_dict: State as returned by :meth:`state_dict`.
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop("dampednewton", None)
        state_dict["param_groups"] = unwrap_settings(state_dict["param_groups"])
        for group in state_dict["param_groups"]:
            _validate_group(group)
        super().load_state_dict(state_dict)
        # torch.optim keeps entries that are not per-parameter by reference: copy them,
        # so that this optimizer's counters are not shared with the source's.
        for key in (GLOBAL, GROUPS):
            if key in self.state:
                self.state[key] = copy.deepcopy(self.state[key])
        self._cached = None
        if extra is not None:
            self._seed = extra["seed"]
            self._generator = None
            if extra["generator"] is not None:
                generator = self._mc_generator(create=True)
                generator.set_state(extra["generator"])

    def _computation_and_extensions(
        self, generator: Generator | None
    ) -> tuple[StepComputation, list]:
        """The computation and its BackPACK extensions, reused while settings hold."""
        first = self.param_groups[0]
        per_sample_gradients = first["subsampling_grad"] is not None or any(
            getattr(as_damping(g["damping"]), "uses_sample_statistics", True)
            for g in self.param_groups
        )
        key = (
            per_sample_gradients,
            first["mc_samples"],
            tuple(first["subsampling_ggn"] or ()),
            tuple(first["subsampling_grad"] or ()),
            id(generator),
        )
        if self._cached is None or self._cached[0] != key:
            computation = StepComputation(
                subsampling_grad=first["subsampling_grad"],
                subsampling_ggn=first["subsampling_ggn"],
                mc_samples_ggn=first["mc_samples"],
                warn_small_eigvals=0,  # the optimizer warns, once per group
                generator=generator,
                per_sample_gradients=per_sample_gradients,
            )
            self._cached = (key, computation, computation.get_extensions())
        computation = self._cached[1]
        computation.curvature_finite = True
        return computation, self._cached[2]

    def _adapt_damping(
        self,
        closure: Callable[[], Tensor],
        loss: Tensor,
        results: list[GroupStep | None],
        scales: list[Tensor | float],
    ) -> None:
        """Feed the reduction ratio to stateful damping policies (Levenberg-Marquardt).

        ``ρ = (L(θ + Δθ) − L(θ)) / q`` with the quadratic model ``q`` of the damped
        Newton steps taken (``lr`` and trust-region scaled, summed over groups; the
        complement's term included, momentum and weight decay not). The loss after
        the step comes from calling the closure again, outside the BackPACK context,
        on the same batch. A policy object shared by several groups is updated once.
        """
        adaptive = list(
            {
                id(group["damping"]): group["damping"]
                for group in self.param_groups
                if hasattr(group["damping"], "update")
            }.values()
        )
        if not adaptive:
            return
        ratio = math.nan
        if any(policy.ratio_needed() for policy in adaptive):
            predicted = sum(
                predicted_change(
                    group["lr"] * scale, result.slope, result.curvature
                ).item()
                for group, result, scale in zip(
                    self.param_groups, results, scales, strict=True
                )
                if result is not None
            )
            with torch.enable_grad(), quiet_backward_hook_warning():
                new_loss = closure().item()
            if not math.isfinite(new_loss):
                ratio = -math.inf
            elif predicted != 0:
                ratio = (new_loss - loss.item()) / predicted
        for policy in adaptive:
            policy.update(ratio)
        self.state[GLOBAL]["reduction_ratio"] = ratio

    def _mc_generator(self, create: bool = False) -> Generator | None:
        if self.param_groups[0]["mc_samples"] == 0 and not create:
            return None
        if self._generator is None:
            device = self.param_groups[0]["params"][0].device
            self._generator = torch.Generator(device=device).manual_seed(self._seed)
        return self._generator

    def _result(self, computation: StepComputation, block: dict) -> GroupStep | None:
        if not any(p.requires_grad for p in block["params"]):
            return None
        try:
            return computation.get_details(block)
        except KeyError as error:
            raise RuntimeError(
                "No curvature information reached the parameters of a group. Extend "
                "model and loss function with BackPACK (`model = backpack.extend("
                "model)`, `loss_fn = backpack.extend(loss_fn)`), make sure the closure "
                "calls `loss.backward()` and that every parameter is used in the "
                "forward pass. A torch.compile'd model can skip BackPACK's hooks "
                "(TorchDynamo reuses graphs compiled for a plain model of the same "
                "class and does not guard on hooks), and gains nothing from "
                "compilation here: step with the uncompiled model."
            ) from error

    def _refuse_nonfinite(
        self, loss: Tensor, results: list[GroupStep | None], curvature_finite: bool
    ) -> bool:
        problem = None
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"The closure must return the loss tensor, got {type(loss).__name__}."
            )
        if not all_finite(loss.detach()):
            problem = f"the loss is {loss.item()}"
        elif not curvature_finite:
            problem = (
                "the damped Newton step is not finite (the GGN is not finite or "
                "its eigendecomposition failed)"
            )
        elif not all_finite(*(s for r in results if r is not None for s in r.step)):
            problem = "the damped Newton step is not finite"
        if problem is None:
            return False
        message = f"DampedNewton refused the update: {problem}; parameters unchanged."
        if self._nonfinite == "raise":
            raise FloatingPointError(
                message + " Pass nonfinite='skip' to skip such steps with a warning."
            )
        warnings.warn(message, RuntimeWarning, stacklevel=STACKLEVEL_OF_CALLER)
        self.state[GLOBAL]["skipped_steps"] += 1
        return True

    def _with_diagnostics(
        self, extensions: list, hook: Callable | None, step: int
    ) -> tuple[list, Callable | None]:
        """Add the monitor's extensions and hook (first) to the step's backward pass.

        The monitor's individual gradients replace the structured ones of the step
        (which skip linear layers); all BackPACK buffers are freed layer by layer.
        """
        if self.monitor is None or not self.monitor.is_active(step):
            return extensions, hook
        merged = {extension.savefield: extension for extension in extensions}
        for extension in self.monitor.extensions(step):
            if extension.savefield == GRAD_BATCH and GRAD_BATCH in merged:
                if self.param_groups[0]["subsampling_grad"] is not None:
                    raise ValueError(
                        "Diagnostics with individual gradients (histograms) need "
                        "subsampling_grad=None."
                    )
                merged[GRAD_BATCH] = IndividualGradients()
            merged.setdefault(extension.savefield, extension)
        monitor_hook = self.monitor.module_hook(step)
        savefields = list(merged)

        def monitor_then_step(module: torch.nn.Module) -> None:
            monitor_hook(module)
            if hook is not None:
                hook(module)
            for param in module.parameters(recurse=False):
                for savefield in savefields:
                    if hasattr(param, savefield):
                        delattr(param, savefield)

        return list(merged.values()), monitor_then_step

    def _finish_diagnostics(self, step: int, loss: Tensor) -> dict | None:
        if self.monitor is None or not self.monitor.is_active(step):
            return None
        params = [p for group in self.param_groups for p in group["params"]]
        return self.monitor.finish(step, params, loss)

    def _record(
        self,
        results: list[GroupStep | None],
        scales: list[Tensor | float],
        record: dict | None = None,
    ) -> None:
        self.state[GLOBAL]["step"] += 1
        stats = self._group_stats()
        for index, (result, scale) in enumerate(zip(results, scales, strict=True)):
            if result is None:
                continue
            num_directions = result.evals.numel()
            stats[index].update(
                trust_region_scale=torch.as_tensor(scale).detach(),
                complement_curvature=result.complement_curvature,
                num_directions=num_directions,
                evals=result.evals.detach(),
                gamma_mean=result.gamma_mean.detach(),
                lambda_mean=result.lambda_mean.detach(),
                damping=result.damping.detach(),
                coefficients=result.coefficients.detach(),
            )
            if record is not None:
                record.update(_newton_record(index, stats[index]))
            if result.factor is None:
                self._count_small_eigenvalues(index, result.evals, stats[index])
            if num_directions == 0:
                stats[index]["steps_without_direction"] += 1
                if index not in self._warned_no_direction:
                    self._warned_no_direction.add(index)
                    warnings.warn(
                        f"The criterion of parameter group {index} selected no "
                        "direction: the group does not move this step (counted in "
                        "optimizer.state['groups'][i]['steps_without_direction']).",
                        stacklevel=STACKLEVEL_OF_CALLER,
                    )

    def _count_small_eigenvalues(
        self, index: int, evals: Tensor, stats: dict[str, Any]
    ) -> None:
        """Count steps along eigenvalues below the threshold; warn once per group."""
        threshold = self.param_groups[index]["warn_small_eigvals"]
        if threshold == 0 or evals.numel() == 0:
            return
        small = int((evals.abs() < threshold).sum())
        if small == 0:
            return
        stats["steps_with_small_eigenvalues"] = (
            stats.get("steps_with_small_eigenvalues", 0) + 1
        )
        if index in self._warned_small_eigenvalues:
            return
        self._warned_small_eigenvalues.add(index)
        warnings.warn(
            f"{small} of the {evals.numel()} GGN eigenvalues selected in parameter "
            f"group {index} are below warn_small_eigvals={threshold} (smallest "
            f"{evals.abs().min().item():.2g}): directions divide by √λ and may be "
            "inaccurate. Select fewer directions (a smaller criterion=k, or "
            "EigenvalueThreshold) or set warn_small_eigvals=0 to silence this. "
            "Warned once per group; the steps are counted in "
            f"optimizer.state['groups'][{index}]['steps_with_small_eigenvalues'].",
            stacklevel=STACKLEVEL_OF_CALLER + 1,  # called by _record
        )


def _refuse_bad_backward(check: SingleBackwardCheck) -> None:
    """Raise when the closure's backward passes do not fit one step.

    Raises:
        RuntimeError: After several backward passes, or into stale gradients.
    """
    problem = check.problem()
    if problem is not None:
        raise RuntimeError(
            f"DampedNewton refused the step: {problem}; parameters and optimizer "
            f"state unchanged. The closure should be\n{CLOSURE_PATTERN}"
        )


def _newton_record(index: int, stats: dict[str, Any]) -> dict[str, Any]:
    """A group's step quantities as entries of a diagnostics record."""
    evals, damping = stats["evals"], stats["damping"]
    return {
        f"newton/num_directions/group{index}": stats["num_directions"],
        f"newton/evals/group{index}": evals.cpu().numpy(),
        f"newton/damping/group{index}": damping.cpu().numpy(),
        f"newton/max_eval/group{index}": evals.max().item() if evals.numel() else 0.0,
        f"newton/mean_damping/group{index}": (
            damping.mean().item() if damping.numel() else 0.0
        ),
    }


def _empty_group_stats() -> dict[str, Any]:
    return {"num_directions": 0, "steps_without_direction": 0}


def _check_shared_settings(groups: list[dict[str, Any]]) -> None:
    first = groups[0]
    for group in groups[1:]:
        for key in SHARED_SETTINGS:
            if _shared_value(group, key) != _shared_value(first, key):
                raise ValueError(
                    f"'{key}' must be the same in all parameter groups (one backward "
                    f"pass serves all): {first[key]!r} vs {group[key]!r}."
                )


def _shared_value(group: dict[str, Any], key: str) -> Any:
    if key == "mc_samples":
        return group[key]
    return validate_subsampling(group[key], key)


def _validate_group(group: dict[str, Any]) -> None:
    lr = group["lr"]
    if isinstance(lr, Tensor):
        lr = lr.item()
    if not isinstance(lr, int | float) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"Invalid learning rate {group['lr']!r}: must be >= 0.")
    as_damping(group["damping"])
    as_criterion(group["criterion"])
    mc_samples = group["mc_samples"]
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int):
        raise TypeError(f"mc_samples must be an int >= 0, got {mc_samples!r}.")
    if mc_samples < 0:
        raise ValueError(f"mc_samples must be >= 0, got {mc_samples}.")
    for key in ("subsampling_ggn", "subsampling_grad"):
        validate_subsampling(group[key], key)
    if not group["warn_small_eigvals"] >= 0:
        raise ValueError(
            f"warn_small_eigvals must be >= 0, got {group['warn_small_eigvals']!r}."
        )
    as_complement(group["complement"])
    _validate_averaging(group["averaging"], group["damping"])
    validate_kl_clip(group["kl_clip"])
    momentum, nesterov, decay = (
        group["momentum"],
        group["nesterov"],
        group["weight_decay"],
    )
    for name, value in (("momentum", momentum), ("weight_decay", decay)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{name} must be a number, got {value!r}.")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}.")
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be True or False, got {nesterov!r}.")
    if nesterov and momentum == 0:
        raise ValueError("nesterov=True needs momentum > 0.")
    if not (math.isfinite(decay) and decay >= 0):
        raise ValueError(f"weight_decay must be >= 0, got {decay!r}.")


def _validate_averaging(averaging: Any, damping: Any) -> None:
    if averaging is None:
        return
    if not isinstance(averaging, CurvatureAveraging):
        raise TypeError(
            "averaging must be None or a CurvatureAveraging(decay=..., rank=..., "
            f"interval=...), got {type(averaging).__name__}."
        )
    if getattr(as_damping(damping), "uses_sample_statistics", True):
        raise ValueError(
            "averaging needs a damping policy that uses mean slopes only (a number, "
            "ConstantDamping or LevenbergMarquardt): the averaged directions have no "
            f"per-sample statistics, got {type(damping).__name__}."
        )


def _updates(factor: AveragedFactor | None) -> int:
    return 0 if factor is None else factor.updates
