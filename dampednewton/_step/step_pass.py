"""The single backward pass of a step: its engine, extensions and hooks.

:class:`StepPass` keeps the step's :class:`~dampednewton.computations.engine.GGNEngine`
(finishing blocks with :class:`~dampednewton._step.group_step.StepFinisher`) and its
BackPACK extensions while the settings that shape them hold, adds the diagnostics
monitor's extensions and hook to the same pass (:func:`.active_monitor.with_monitor`),
and runs the
closure inside that pass (:func:`~dampednewton.backpack.passes.backward_pass`) under
the one-backward check (:func:`run_closure`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from backpack.extensions.backprop_extension import BackpropExtension
from torch import Generator, Tensor

from dampednewton._step.active_monitor import (
    ActiveMonitor,
    checked_sampling,
    with_monitor,
)
from dampednewton._step.amortized import FrozenBases, frozen_group_step, trust_bound
from dampednewton._step.averaged_step import averaged_step
from dampednewton._step.closure import failure_shared, run_closure
from dampednewton._step.group_result import GroupStep
from dampednewton._step.group_step import StepFinisher
from dampednewton._step.options import GroupOptions, SharedOptions
from dampednewton._step.step_block import STEP_BLOCK, StepBlock, step_block
from dampednewton.backpack.extensions import (
    ExactSqrtGGN,
    IndividualGradients,
    MonteCarloSqrtGGN,
)
from dampednewton.backpack.global_batch import GlobalBatch
from dampednewton.backpack.hooks import ExtendedModules
from dampednewton.backpack.loss_checks import DeferredChecks
from dampednewton.backpack.passes import Hook
from dampednewton.computations.engine import GGNEngine, GGNSettings
from dampednewton.distributed import Communicator
from dampednewton.policies.damping import needs_sample_statistics

StepEngine = GGNEngine[GroupStep | None]


class PassResult(NamedTuple):
    """What :meth:`StepPass.run` gives the step.

    Attributes:
        loss: The closure's loss (under data parallelism: the ranks' mean; ``None``
            when the closure returned ``None`` on every rank).
        results: Every group's step (``None``: no trainable parameter).
        solved: Whether every group's eigensolver succeeded.
        deferred: The checks that the BackPACK hooks left for the step to read (its
            other checks are in the steps).
    """

    loss: Tensor | None
    results: list[GroupStep | None]
    solved: bool
    deferred: DeferredChecks


class StepPass:
    """The step's engine and extensions, rebuilt only when settings change."""

    def __init__(self) -> None:
        """Start without an engine."""
        self._cached: tuple[tuple, StepEngine, StepFinisher, list] | None = None
        self.extended_modules = ExtendedModules()
        self.bases = FrozenBases()

    def clear(self) -> None:
        """Forget the engine and the frozen bases (after loading a state)."""
        self._cached = None
        self.bases.clear()

    def run(
        self,
        closure: Callable[[], Tensor],
        groups: Sequence[dict[str, Any]],
        options: Sequence[GroupOptions],
        shared: SharedOptions,
        state: Mapping,
        stats: Sequence[dict[str, Any]] | None,
        *,
        generator: Generator | None,
        monitor: ActiveMonitor | None,
        step: int,
        communicator: Communicator | None = None,
        refresh: bool = False,
    ) -> PassResult:
        """Run the closure's one backward pass and compute every group's direction.

        Groups whose averaged factor is not refreshed this step reuse it; when no
        group refreshes and no monitor is active, the closure runs without BackPACK
        extensions. Under data parallelism (``communicator``) the ranks agree on
        their passes after the backward pass, then reduce the global batch (the
        sub-sampling indices are local: every rank contributes those samples of its
        batch); the loss returned is the ranks' mean.

        Args:
            closure: ``zero_grad``, forward, ``backward``; returns the loss.
            groups: The param groups.
            options: Their validated options.
            shared: The options of the backward pass.
            state: The optimizer's state (the groups' averaged bases).
            stats: The groups' statistics (their averaged factors' weights), or
                ``None`` before the first step.
            generator: The Monte-Carlo generator, or ``None``.
            monitor: The diagnostics monitor if it is active this step.
            step: The step's index.
            communicator: The ranks' collectives, ``None`` for one process.
            refresh: Refresh every averaged group, whatever its schedule says.

        Returns:
            The loss, the groups' steps, whether the eigensolvers succeeded, and the
            hooks' deferred checks.
        """
        blocks = [
            step_block(group, option, state, stats, index)
            for index, (group, option) in enumerate(zip(groups, options, strict=True))
        ]
        per_sample_gradients = shared.subsampling_grad is not None or any(
            needs_sample_statistics(option.damping) for option in options
        )
        refreshing = [refresh or block.refreshes(step) for block in blocks]
        engine: StepEngine | None = None
        finisher: StepFinisher | None = None
        extensions: list[BackpropExtension] = []
        hooks: list[Hook] = []
        if any(refreshing):
            engine, finisher, extensions = self.get(
                shared, per_sample_gradients, generator, communicator
            )
            hooks = [
                engine.hook(
                    [
                        b.engine_group()
                        for b, refresh in zip(blocks, refreshing, strict=True)
                        if refresh
                    ]
                )
            ]
        if monitor is not None:
            extensions, hooks = with_monitor(
                extensions, hooks, monitor, shared.subsampling_grad
            )
        params = [p for block in blocks for p in block.params]
        deferred = DeferredChecks()
        for extension in extensions:
            if isinstance(
                extension, ExactSqrtGGN | MonteCarloSqrtGGN | IndividualGradients
            ):
                extension.deferred_checks = deferred
        with failure_shared(communicator), checked_sampling(extensions, deferred):
            loss = run_closure(
                closure,
                params,
                extensions,
                hooks,
                self.extended_modules,
                accumulation=monitor is None,
                deferred=deferred,
            )
        if communicator is not None:
            finite = deferred.model_output_finite
            if finite is not None and isinstance(loss, Tensor):
                loss = loss.where(finite, math.nan)
            # Between refreshes the loss modules counted the samples.
            samples = deferred.local_samples if engine is None else engine.batch_size
            loss = communicator.mean_loss_of_pass(loss, samples or None)
            if loss is None:  # every rank skips the batch
                return PassResult(loss, [None] * len(blocks), True, deferred)
            if not torch.isfinite(loss):
                return PassResult(loss, [None] * len(blocks), True, deferred)
            if engine is not None:
                engine.reduce_kept()
        elif loss is None:  # a skipped batch: no backward pass, nothing to reduce
            return PassResult(loss, [None] * len(blocks), True, deferred)
        elif engine is not None:
            engine.reduce_kept()  # the micro-batches of gradient accumulation
        with torch.no_grad():
            results = [
                _result(engine, block)
                if refresh
                else _reused(block, self.bases.get(index, state, block.params))
                for index, (block, refresh) in enumerate(
                    zip(blocks, refreshing, strict=True)
                )
            ]
        solved = finisher is None or finisher.eigensolver_succeeded
        return PassResult(loss, results, solved, deferred)

    def get(
        self,
        shared: SharedOptions,
        per_sample_gradients: bool,
        generator: Generator | None,
        communicator: Communicator | None = None,
    ) -> tuple[StepEngine, StepFinisher, list]:
        """The engine, its finisher (reset for a new step) and BackPACK extensions.

        Args:
            shared: The options of the backward pass.
            per_sample_gradients: Whether a damping policy needs per-sample slopes.
            generator: The Monte-Carlo generator, or ``None`` for the exact GGN.
            communicator: The ranks' collectives: the engine then reduces the
                global batch. ``None`` for one process.

        Returns:
            The engine, the finisher it calls, and its extensions.
        """
        key = (
            per_sample_gradients,
            shared.mc_samples,
            tuple(shared.subsampling_ggn or ()),
            tuple(shared.subsampling_grad or ()),
            id(generator),
            id(communicator),
        )
        if self._cached is None or self._cached[0] != key:
            settings = GGNSettings(
                subsampling_ggn=shared.subsampling_ggn,
                subsampling_grad=shared.subsampling_grad,
                mc_samples=shared.mc_samples,
                generator=generator,
            )
            finisher = StepFinisher(
                per_sample_gradients=per_sample_gradients,
                subsampling_grad=settings.subsampling_grad,
            )
            engine = GGNEngine(
                settings,
                finisher,
                required_group_keys=(STEP_BLOCK,),
                keeps_factors=True,
                needs_gradients=per_sample_gradients,
                defers_finish=True,  # the finisher reads the complete .grad
            )
            engine.accumulates = True
            if communicator is not None:
                engine.global_batch = GlobalBatch(
                    communicator.gather_samples,
                    communicator.world_size,
                    subsampling_grad=settings.subsampling_grad,
                    per_sample_gradients=per_sample_gradients,
                )
            extensions = engine.extensions()
            self._cached = (key, engine, finisher, extensions)
        _, engine, finisher, extensions = self._cached
        finisher.reset()
        return engine, finisher, extensions


def _result(engine: StepEngine | None, block: StepBlock) -> GroupStep | None:
    """A group's step from the engine (``None`` without trainable parameters).

    Raises:
        RuntimeError: When no curvature reached the group's parameters (but some
            have a gradient).
    """
    # No step for a group without trainable parameters, or that this step's forward
    # pass did not use (no gradient either, as torch.optim skips them).
    if not any(p.requires_grad and p.grad is not None for p in block.params):
        return None
    if engine is None:
        raise RuntimeError("A refreshed group's step needs the engine.")
    try:
        return engine.result(block.engine_group())
    except KeyError as error:
        raise RuntimeError(
            "No curvature information reached the parameters of a group. Extend "
            "model and loss function with BackPACK (`model = backpack.extend("
            "model)`, `loss_fn = backpack.extend(loss_fn)`), make sure the closure "
            "calls `loss.backward()` and that every parameter is used in the "
            "forward pass (a group's parameters all, or none: put parameters that "
            "some steps leave unused in groups of their own). A torch.compile'd "
            "model can skip BackPACK's hooks "
            "(TorchDynamo reuses graphs compiled for a plain model of the same "
            "class and does not guard on hooks), and gains nothing from "
            "compilation here: step with the uncompiled model."
        ) from error


def _reused(block: StepBlock, basis: Tensor) -> GroupStep:
    """A group's step along its averaged factor between refreshes.

    ``basis`` is the factor as one ``[r, D]`` matrix, built once per refresh.
    """
    assert block.factor is not None  # a group without one refreshes
    if block.frozen is None:  # a factor from a state saved before frozen coefficients
        return averaged_step(block, block.factor)
    bound = trust_bound(block.options.kl_clip)
    return frozen_group_step(block.params, basis, block.frozen, bound)
