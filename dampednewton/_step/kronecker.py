r"""The Kronecker basis' step: refreshes of the layers' factors and every step.

A step of groups with :class:`~dampednewton.policies.basis.KroneckerBasis` runs the
closure once. On a refresh (the averaging's schedule, a loss that rose above its
tolerance, or the first step) a pass (:mod:`._step.factor_pass`) gives each layer's
factors ``A`` and ``S``: BackPACK's, whose hook
(:class:`~dampednewton.backpack.kronecker_hook.FactorCollector`) turns the layers'
square-root buffers into them, or, for later Monte-Carlo refreshes, one
``torch.autograd.grad`` of the sampled square root; the averages
``F ← βF + (1 − β)F_batch`` are decomposed or, between rotations, given new
eigenvalues along their eigenvectors (:mod:`._step.kronecker_refresh`). Every other
step runs the closure with BackPACK's hooks suspended and reuses the layers'
eigenpairs.

Each layer's direction is :func:`~dampednewton.math.kronecker.kronecker_direction` of
its gradient (with a :class:`~dampednewton.NoiseFilter`, its kept coefficients scaled
by :mod:`._step.kronecker_moments`); a group's quadratic model sums its layers'
slopes (and curvatures, when adaptive damping reads them), and its trust region
``ν`` bounds ``½ ν² (−ḡᵀs)`` by ``kl_clip`` (the learning rate scales the bounded
step). One host read per step carries the loss, every group's slope (a non-finite
gradient or direction makes it non-finite), the hooks' checks and the new factors'
finiteness (:mod:`._step.kronecker_checks`). A refused step leaves parameters, state
and generator untouched: the new factors (and moments) are committed only with an
accepted step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Generator, Tensor

from dampednewton._step.active_monitor import (
    ActiveMonitor,
    checked_sampling,
    with_monitor,
)
from dampednewton._step.closure import failure_shared, run_closure
from dampednewton._step.factor_pass import FactorPasses
from dampednewton._step.guard import (
    STACKLEVEL_OF_CALLER,
    GeneratorSnapshot,
    check_loss_type,
    refuse,
)
from dampednewton._step.kronecker_checks import loss_rose, read_checks, refusal
from dampednewton._step.kronecker_group import (
    KroneckerGroupStep,
    LayerBatch,
    group_step,
    layer_batches,
)
from dampednewton._step.kronecker_moments import (
    MOMENTS_REFRESH,
    current_moments,
    group_noise_filter,
    moment_entries,
)
from dampednewton._step.kronecker_packed import PackedGroup, packable
from dampednewton._step.kronecker_refresh import (
    RefreshedBatch,
    commit_layers,
    factors_finite,
    mean_over_ranks,
    refreshed_layers,
)
from dampednewton._step.kronecker_state import (
    LAYERS,
    UPDATES,
    bases_in_state,
    eigen_versions,
    stored_bases,
)
from dampednewton._step.options import GroupOptions, SharedOptions
from dampednewton._step.quadratic_model import trust_region_scale_on_host
from dampednewton._step.records import (
    REFRESH_DUE,
    REFRESH_LOSS,
    note_first_refresh,
    refreshes_at,
)
from dampednewton._step.update import update_parameters
from dampednewton.backpack.extensions import modified_loss_warning
from dampednewton.backpack.hooks import ExtendedModules
from dampednewton.backpack.loss_checks import DeferredChecks
from dampednewton.distributed import Communicator
from dampednewton.policies.basis import KroneckerBasis


def damping_value(options: GroupOptions) -> float:
    """The group's ``δ`` (its policy's current value)."""
    return float(options.damping.value)  # type: ignore[attr-defined]


class KroneckerSteps:
    """Steps of Kronecker-basis groups; keeps the layers' bases between steps."""

    def __init__(self) -> None:
        """Start without cached bases."""
        self._batches: dict[int, list[LayerBatch]] = {}
        self._versions: dict[int, list[tuple[int, ...]]] = {}
        self._packs: dict[int, PackedGroup] = {}
        self._passes = FactorPasses()

    def clear(self) -> None:
        """Forget the cached bases (after loading a state)."""
        self._batches.clear()
        self._versions.clear()
        self._packs.clear()

    def run(
        self,
        closure: Callable[[], Tensor],
        groups: Sequence[dict[str, Any]],
        options: Sequence[GroupOptions],
        shared: SharedOptions,
        state: Any,
        stats: list[dict[str, Any]],
        global_state: dict[str, Any],
        *,
        step: int,
        generator: Generator | None,
        monitor: ActiveMonitor | None,
        communicator: Communicator | None,
        nonfinite: str,
        modules: ExtendedModules,
        with_curvature: bool,
    ) -> KroneckerPass:
        """Run the closure and move every group; see the module docstring.

        Returns:
            What the step did (a refused step leaves parameters, state and
            generator untouched).
        """
        due = bool(global_state.get(REFRESH_DUE, False))
        refreshing = [
            due
            or option.averaging is None
            or LAYERS not in group
            or refreshes_at(option.averaging, group, step)
            for option, group in zip(options, stats, strict=True)
        ]
        # An adaptive damping adapts on refreshes only: its model's curvature then.
        with_curvature = with_curvature and any(refreshing)
        params = [p for group in groups for p in group["params"]]
        deferred = DeferredChecks()
        factor_pass = None
        extensions: list = []
        hooks: list = []
        if any(refreshing):
            factor_pass = self._passes.start(
                shared,
                generator,
                [
                    p
                    for group, refresh in zip(groups, refreshing, strict=True)
                    if refresh
                    for p in group["params"]
                    if p.requires_grad
                ],
                deferred,
                bases_stored=all(
                    LAYERS in group
                    for group, refresh in zip(stats, refreshing, strict=True)
                    if refresh
                ),
                monitored=monitor is not None,
            )
            extensions, hooks = factor_pass.extensions, factor_pass.hooks
        if monitor is not None:
            extensions, hooks = with_monitor(extensions, hooks, monitor, None)
        layers = None
        with GeneratorSnapshot(generator if factor_pass is not None else None) as saved:
            with (
                failure_shared(communicator),
                checked_sampling(extensions, deferred),
                nullcontext() if factor_pass is None else factor_pass.collecting(),
            ):
                loss = run_closure(
                    closure,
                    params,
                    extensions,
                    hooks,
                    modules,
                    monitor is None,
                    deferred,
                )
                if factor_pass is not None and loss is not None:
                    layers = factor_pass.layers()
            # None: a skipped batch (check_loss_type raises), else the autograd pass
            fell_short = factor_pass is not None and loss is not None and layers is None
            if communicator is not None:  # refuses unequal local batches everywhere
                loss = communicator.mean_loss_of_pass(
                    loss, deferred.local_samples or None, fell_short
                )
                if communicator.without_factors:  # on a rank: none refreshes
                    fell_short, layers = True, None
            if fell_short:  # the autograd pass: keep the bases, then use BackPACK
                self._passes.autograd = with_curvature = False
            check_loss_type(loss)
            fresh: dict[int, list[RefreshedBatch]] = {}
            finite = None
            if layers is not None:
                if communicator is not None:
                    mean_over_ranks(layers, communicator)
                try:
                    for index, refresh in enumerate(refreshing):
                        if refresh:
                            fresh[index] = refreshed_layers(
                                groups[index],
                                options[index],
                                stats[index],
                                state,
                                layers,
                            )
                    finite = factors_finite(
                        [batch for batches in fresh.values() for batch in batches]
                    )
                except torch.linalg.LinAlgError:
                    # LAPACK fails on non-finite factors; else the read refuses.
                    fresh.clear()
                    finite = torch.zeros((), dtype=torch.bool)
            steps: list[KroneckerGroupStep | None] = [None] * len(groups)
            for index, group in enumerate(groups):
                batches: list[LayerBatch] | None
                if index in fresh:
                    batches = [refreshed.batch for refreshed in fresh[index]]
                else:
                    batches = self._batches_of(index, group, stats[index], state)
                if batches:
                    steps[index] = self._group_step(
                        index,
                        batches,
                        options[index],
                        stats[index],
                        state,
                        with_curvature,
                    )
            values = read_checks(loss, steps, deferred, finite)
            try:
                problem = refusal(values, deferred, [damping_value(o) for o in options])
            except ValueError as error:
                if communicator is not None:  # the other ranks refuse the step too
                    communicator.refusal(str(error))
                raise
            if communicator is not None:
                problem = communicator.refusal(problem)
            if problem is not None:
                saved.restore()
                refuse(problem, nonfinite, stacklevel=STACKLEVEL_OF_CALLER + 2)
                global_state["skipped_steps"] += 1
                count = len(groups)
                return KroneckerPass(loss, [None] * count, [1.0] * count, None, False)
            record = None if monitor is None else monitor.finish(params, loss)
        if not values["loss_unscaled"]:
            warnings.warn(
                modified_loss_warning(deferred.loss_name, len(deferred.loss_weights)),
                stacklevel=STACKLEVEL_OF_CALLER + 1,
            )
        for index, refreshed in fresh.items():
            batches = commit_layers(refreshed, groups[index], stats[index], state)
            note_first_refresh(stats[index], step)
            if batches is None:  # a layer kept its basis: all read from the state
                self._batches.pop(index, None)
                self._batches_of(index, groups[index], stats[index], state)
            else:
                self._cache(index, batches)
        if fresh:
            global_state.update({REFRESH_DUE: False, REFRESH_LOSS: values["loss"]})
        elif fell_short or loss_rose(options, global_state, values["loss"]):
            global_state[REFRESH_DUE] = True
        scales = []
        for option, result, slope, group_stats in zip(
            options, steps, values["slopes"], stats, strict=True
        ):
            scale = trust_region_scale_on_host(slope, option.kl_clip)
            scales.append(scale)
            if result is not None:
                _apply(result, option, state, scale)
                for first, moments in result.moments:
                    if first.grad is not None:  # an unused layer's stay, as Adam's
                        state[first].update(moment_entries(moments))
                if result.moments:
                    group_stats[MOMENTS_REFRESH] = group_stats[UPDATES]
        return KroneckerPass(loss, steps, scales, record, True, bool(fresh))

    def _group_step(
        self,
        index: int,
        batches: list[LayerBatch],
        option: GroupOptions,
        stats: dict[str, Any],
        state: Any,
        with_curvature: bool,
    ) -> KroneckerGroupStep:
        """Group ``index``'s step: packed (:mod:`.kronecker_packed`) or by shape."""
        damping = damping_value(option)
        noise_filter = group_noise_filter(option)
        basis = option.basis
        device = batches[0].output.vectors.device
        if (
            isinstance(basis, KroneckerBasis)
            and basis.packs(device)
            and noise_filter is None
            and option.adaptive_damping is None
            and not with_curvature
            and packable(batches)
        ):
            graphed = basis.graphs(device)
            pack = self._packs.get(index)
            if pack is None or not pack.refill(batches, graphed):
                pack = self._packs[index] = PackedGroup(batches, graphed)
            return pack.step(damping)
        return group_step(
            batches,
            damping,
            with_curvature,
            noise_filter,
            state,
            noise_filter is not None and current_moments(stats),
        )

    def largest_curvatures(self, index: int) -> Any:
        """Group ``index``'s largest curvature ``τ_max σ_max`` per layer (NumPy).

        Reads the device: for diagnostics records only.
        """
        values = [
            (layer.output.values.max() * layer.inputs.values.max()).double()
            for batch in self._batches.get(index) or []
            for layer in batch.layers
        ]
        return torch.stack(values).cpu().numpy() if values else torch.zeros(0).numpy()

    def _batches_of(
        self, index: int, group: dict[str, Any], stats: dict[str, Any], state: Any
    ) -> list[LayerBatch] | None:
        """Group ``index``'s batches: cached, or read from the state after a load.

        Also read again when the state's eigenpairs were replaced or edited in
        place since they were cached (e.g. moved to another device).
        """
        batches = self._batches.get(index)
        if batches is not None and not (
            all(bases_in_state(batch.layers, state) for batch in batches)
            and [eigen_versions(batch.layers) for batch in batches]
            == self._versions.get(index)
        ):
            batches = None
        if batches is None:
            bases = stored_bases(state, stats, group["params"])
            if bases is not None:
                batches = self._cache(index, layer_batches(bases))
        return batches

    def _cache(self, index: int, batches: list[LayerBatch]) -> list[LayerBatch]:
        """Keep group ``index``'s batches and their eigenpairs' versions."""
        self._batches[index] = batches
        self._versions[index] = [eigen_versions(batch.layers) for batch in batches]
        return batches


@dataclass(frozen=True)
class KroneckerPass:
    """What a Kronecker step did.

    Attributes:
        loss: The closure's loss (under data parallelism: the ranks' mean).
        steps: Every group's step (``None``: the group has nothing to move).
        scales: Every group's trust-region scale ``ν``.
        record: The diagnostics monitor's record of the step, if it was active.
        accepted: Whether the step was taken (``False``: refused).
        refreshed: Whether a group's curvature was refreshed (an adaptive damping
            adapts on such steps only).
    """

    loss: Tensor
    steps: list[KroneckerGroupStep | None]
    scales: list[float]
    record: dict | None
    accepted: bool
    refreshed: bool = False


def _apply(
    result: KroneckerGroupStep, option: GroupOptions, state: Any, scale: float
) -> None:
    """Move a group's parameters by ``lr·ν·s`` (momentum and weight decay included)."""
    with torch.no_grad():
        update_parameters(result.directions, state, option, scale)
