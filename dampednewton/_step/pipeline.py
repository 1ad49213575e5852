"""One optimizer step from start to end: the lean frozen step or the full one.

:class:`Pipeline` holds what :class:`~dampednewton.DampedNewton` keeps between steps
(the step pass with its frozen bases, the validated options, the recorder, the seeded
generator, the communicator) and runs a step on the optimizer's param groups and
state and records, in the order of :mod:`dampednewton._step`.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Generator, Tensor

from dampednewton._step.active_monitor import ActiveMonitor
from dampednewton._step.adaptation import adapt, claim, distinct_adaptive
from dampednewton._step.amortized import (
    between_refreshes,
    gradient_vector,
    record_step_lengths,
    stored_frozen,
    trust_bound,
)
from dampednewton._step.closure import run_closure
from dampednewton._step.dtypes import ParameterDtypes
from dampednewton._step.guard import (
    STACKLEVEL_OF_CALLER,
    ClosureReturnedNone,
    GeneratorSnapshot,
    StepRollback,
    check_loss_type,
    nonfinite_problem,
    refuse,
)
from dampednewton._step.kronecker import KroneckerSteps, damping_value
from dampednewton._step.options import (
    GroupOptions,
    SharedOptions,
    ValidatedGroups,
    loss_tolerance,
)
from dampednewton._step.records import (
    GLOBAL,
    GROUPS,
    REFRESH_DUE,
    REFRESH_LOSS,
    StepRecorder,
    check_basis_unchanged,
    group_stats,
    store_factors,
)
from dampednewton._step.replicas import check_replicas_equal
from dampednewton._step.step_pass import StepPass
from dampednewton._step.step_status import read_status, settled
from dampednewton._step.update import apply_flat_step, apply_steps
from dampednewton.backpack.extensions import modified_loss_warning
from dampednewton.backpack.loss_checks import DeferredChecks, targets_error
from dampednewton.backpack.seeding import SeededGenerator
from dampednewton.diagnostics import DiagnosticsMonitor
from dampednewton.distributed import Communicator
from dampednewton.math.frozen_basis import frozen_basis_step, trust_scale_on_host
from dampednewton.process_groups import check_created_after_init

State = dict[Any, Any]
Records = dict[str, Any]
Groups = list[dict[str, Any]]


class Pipeline:
    """The step machinery of one optimizer and what it keeps between steps.

    Args:
        nonfinite: ``'raise'`` or ``'skip'`` (validated).
        communicator: Data parallelism, or ``None`` for one process.
        seeded: The optimizer's Monte-Carlo generator.
        before_init: Created with the default process group before
            ``torch.distributed`` was initialized (a step under several processes
            is refused).
    """

    def __init__(
        self,
        nonfinite: str,
        communicator: Communicator | None,
        seeded: SeededGenerator,
        before_init: bool = False,
    ) -> None:
        self.nonfinite = nonfinite
        self.before_init = before_init
        self.communicator = communicator
        self.seeded = seeded
        self.step_pass = StepPass()
        self.kronecker = KroneckerSteps()
        self.validated = ValidatedGroups()
        self.recorder = StepRecorder()
        self.dtypes = ParameterDtypes()

    def clear(self) -> None:
        """Forget what depends on the state (after loading a state dict)."""
        self.step_pass.clear()
        self.kronecker.clear()
        self.dtypes = ParameterDtypes()  # the next step compares the state

    def step(
        self,
        closure: Callable[[], Tensor],
        groups: Groups,
        state: State,
        records: Records,
        monitor: DiagnosticsMonitor | None,
    ) -> Tensor | None:
        """Take one step on ``groups``, ``state`` and ``records``; return the loss.

        ``None`` when the closure returned ``None`` without back-propagating (a
        skipped batch): nothing changes. ``records``: the step counters and group
        statistics (:mod:`._step.records`). A step that raises leaves parameters,
        state, records and generator as they were (:class:`.guard.StepRollback`).
        """
        check_created_after_init(self.before_init)
        options, shared = self.validated.get(groups)
        check_basis_unchanged(records.get(GROUPS, ()), shared.kronecker)
        if self.dtypes.follow(groups, state, records.get(GROUPS, ())):
            self.clear()  # the model changed dtype: its state was converted
        step_index = records[GLOBAL]["step"]
        params = [p for group in groups for p in group["params"]]
        if self.communicator is not None and step_index == 0:
            check_replicas_equal(self.communicator, params)
        calls = step_index + records[GLOBAL].get("skipped_steps", 0)
        active = ActiveMonitor.at(monitor, calls)
        # Between refreshes the Gram basis steps along its frozen bases (the lean
        # path, or with a monitor or data parallelism the general one); the damping
        # adapts on refreshes only, so that neither changes the trajectory.
        between = not shared.kronecker and between_refreshes(
            options, records, step_index
        )
        lean = between and active is None and self.communicator is None
        adaptive = distinct_adaptive(option.adaptive_damping for option in options)
        claim(adaptive, self)
        rollback = StepRollback(
            params,
            state,
            records,
            step_index,
            self.seeded.created,
            # Only a step that adapts the damping calls the closure again.
            full=not between and any(policy.ratio_needed() for policy in adaptive),
            monitor=active,
        )
        try:
            if shared.kronecker:
                return self._kronecker_step(
                    closure, groups, options, shared, state, records, active
                )
            if lean:
                return self._frozen_step(closure, groups, options, state, records)
            return self._full_step(
                closure, groups, options, shared, state, records, active, not between
            )
        except BaseException as error:
            if rollback.restore(records[GLOBAL]["step"]):
                self.clear()
            if isinstance(error, ClosureReturnedNone) and error.skipped:
                return None  # a skipped batch: nothing back-propagated, nothing moves
            raise

    def _full_step(
        self,
        closure: Callable[[], Tensor],
        groups: Groups,
        options: Sequence[GroupOptions],
        shared: SharedOptions,
        state: State,
        records: Records,
        active: ActiveMonitor | None,
        adapts: bool,
    ) -> Tensor:
        """A step with a BackPACK pass; ``adapts``: the adaptive dampings see it."""
        step_index = records[GLOBAL]["step"]
        generator = self.mc_generator(groups, records)
        with GeneratorSnapshot(generator) as snapshot:
            passed = self.step_pass.run(
                closure,
                groups,
                options,
                shared,
                state,
                records.get(GROUPS),
                generator=generator,
                monitor=active,
                step=step_index,
                communicator=self.communicator,
                refresh=records[GLOBAL].get(REFRESH_DUE, False),
            )
            loss, results = check_loss_type(passed.loss), passed.results
            thresholds = [option.warn_small_eigvals for option in options]
            status = read_status(loss, results, thresholds, passed.deferred)
            try:
                status.check_inputs(results, passed.deferred)
            except ValueError as error:  # the other ranks refuse the step too
                if self.communicator is not None:
                    self.communicator.refusal(str(error))
                raise
            if not status.loss_unscaled:
                warnings.warn(
                    modified_loss_warning(
                        passed.deferred.loss_name, len(passed.deferred.loss_weights)
                    ),
                    stacklevel=STACKLEVEL_OF_CALLER,
                )
            problem = nonfinite_problem(loss, status, passed.solved)
            if self.communicator is not None:
                problem = self.communicator.refusal(problem)
            if problem is not None:
                snapshot.restore()
                refuse(problem, self.nonfinite, stacklevel=STACKLEVEL_OF_CALLER + 1)
                records[GLOBAL]["skipped_steps"] += 1
                return loss
            record = None
            if active is not None:
                params = [p for group in groups for p in group["params"]]
                record = active.finish(params, loss)
        results = [
            settled(result, group)
            for result, group in zip(results, status.groups, strict=True)
        ]
        scales = apply_steps(
            [group["params"] for group in groups], options, results, state
        )
        stats = group_stats(records, groups)
        store_factors(state, stats, groups, results, records[GLOBAL]["step"])
        if any(result is not None and result.factor for result in results):
            record_step_lengths(stats, results, scales)
            self.step_pass.bases.clear()
            records[GLOBAL].update({REFRESH_DUE: False, REFRESH_LOSS: loss.detach()})
        records[GLOBAL]["step"] += 1
        small = [
            0 if group is None else group.small_eigenvalues for group in status.groups
        ]
        self.recorder.record(stats, thresholds, small, results, scales, record)
        adaptive = distinct_adaptive(option.adaptive_damping for option in options)
        if adaptive and adapts:
            multiples = [o.lr * scale for o, scale in zip(options, scales, strict=True)]
            records[GLOBAL]["reduction_ratio"] = adapt(
                adaptive,
                closure,
                loss,
                zip(multiples, results, strict=True),
                mean_over_ranks=None
                if self.communicator is None
                else self.communicator.mean,
            )
        return loss

    def _kronecker_step(
        self,
        closure: Callable[[], Tensor],
        groups: Groups,
        options: Sequence[GroupOptions],
        shared: SharedOptions,
        state: State,
        records: Records,
        monitor: ActiveMonitor | None,
    ) -> Tensor:
        """A step of Kronecker-basis groups (:mod:`._step.kronecker`)."""
        step_index = records[GLOBAL]["step"]
        stats = group_stats(records, groups)
        adaptive = distinct_adaptive(option.adaptive_damping for option in options)
        taken = self.kronecker.run(
            closure,
            groups,
            options,
            shared,
            state,
            stats,
            records[GLOBAL],
            step=step_index,
            generator=self.mc_generator(groups, records),
            monitor=monitor,
            communicator=self.communicator,
            nonfinite=self.nonfinite,
            modules=self.step_pass.extended_modules,
            with_curvature=any(policy.ratio_needed() for policy in adaptive),
        )
        if not taken.accepted:
            return taken.loss
        records[GLOBAL]["step"] += 1
        for index, (option, scale) in enumerate(
            zip(options, taken.scales, strict=True)
        ):
            stats[index].update(trust_region_scale=scale, damping=damping_value(option))
            if taken.record is not None:
                taken.record.update(
                    {
                        f"newton/damping/group{index}": damping_value(option),
                        f"newton/trust_region_scale/group{index}": scale,
                        f"newton/layer_curvatures/group{index}": (
                            self.kronecker.largest_curvatures(index)
                        ),
                    }
                )
        if adaptive and taken.refreshed:  # as the Gram basis: on refreshes only
            multiples = [
                o.lr * scale for o, scale in zip(options, taken.scales, strict=True)
            ]
            records[GLOBAL]["reduction_ratio"] = adapt(
                adaptive,
                closure,
                taken.loss,
                zip(multiples, taken.steps, strict=True),
                mean_over_ranks=None
                if self.communicator is None
                else self.communicator.mean,
            )
        return taken.loss

    def mc_generator(self, groups: Groups, records: Records) -> Generator | None:
        """The Monte-Carlo generator, ``None`` for the exact GGN."""
        if groups[0]["mc_samples"] == 0:
            return None
        device = groups[0]["params"][0].device
        if self.communicator is not None:
            rank = self.communicator.rank
            return self.seeded.for_rank(device, rank, records[GLOBAL]["step"])
        return self.seeded.get(device)

    def _frozen_step(
        self,
        closure: Callable[[], Tensor],
        groups: Groups,
        options: Sequence[GroupOptions],
        state: State,
        records: Records,
    ) -> Tensor:
        """A step between refreshes: plain backward pass, steps along frozen bases.

        One host read (whether loss and steps are finite); a refused step leaves
        parameters and state untouched.
        """
        params = [p for group in groups for p in group["params"]]
        deferred = DeferredChecks()
        loss = run_closure(
            closure, params, [], [], self.step_pass.extended_modules, deferred=deferred
        )
        check_loss_type(loss)
        with torch.no_grad():
            steps, frozens = [], []
            for index, group in enumerate(groups):
                basis = self.step_pass.bases.get(index, state, group["params"])
                frozen = stored_frozen(records[GROUPS][index])
                assert frozen is not None  # checked by between_refreshes
                gradient = gradient_vector(group["params"], basis)
                steps.append(frozen_basis_step(basis, gradient, frozen))
                frozens.append(frozen)
            # One read: the loss (and the last refresh's), each step's slope, squared
            # length, frozen excess and length (non-finite if anything is).
            reference = records[GLOBAL].get(REFRESH_LOSS)
            read = [loss.detach(), loss.detach() if reference is None else reference]
            for step, frozen in zip(steps, frozens, strict=True):
                read += [
                    step.slope,
                    step.direction.square().sum(),
                    frozen.curvature_excess,
                    frozen.step_length,
                ]
            ignored = deferred.ignored_targets
            if ignored is not None:
                read.append(ignored)
            dtype = functools.reduce(torch.promote_types, (t.dtype for t in read))
            values = torch.stack([t.to(dtype) for t in read]).tolist()
            if ignored is not None and (count := int(values.pop())):
                raise targets_error(count, deferred)
            if not all(math.isfinite(value) for value in values[:2] + values[2::4]):
                refuse(
                    "the loss or the step is not finite",
                    self.nonfinite,
                    stacklevel=STACKLEVEL_OF_CALLER + 1,
                )
                records[GLOBAL]["skipped_steps"] += 1
                return loss
            tolerance = loss_tolerance(options)
            if tolerance is not None and values[0] > (1 + tolerance) * values[1]:
                records[GLOBAL][REFRESH_DUE] = True
            for index, (group, option, step) in enumerate(
                zip(groups, options, steps, strict=True)
            ):
                slope, squares, excess, length = values[2 + 4 * index : 6 + 4 * index]
                bound = trust_bound(option.kl_clip)
                scale = trust_scale_on_host(slope, squares, excess, length, bound)
                apply_flat_step(group["params"], step.direction, state, option, scale)
        records[GLOBAL]["step"] += 1
        return loss
