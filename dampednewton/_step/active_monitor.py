"""The diagnostics monitor of a step: its extensions and hook in the step's pass.

A record's ``"step"`` counts the optimizer's ``step`` calls, refused ones included
(``nonfinite="skip"``), as a training loop's counter and Lightning's
``trainer.global_step`` do (a closure returning ``None`` skips its batch without a
trace, its count included); the curvature refresh schedules count the steps taken.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dampednewton.backpack.extensions import IndividualGradients
from dampednewton.backpack.loss_checks import DeferredChecks
from dampednewton.backpack.passes import Hook
from dampednewton.backpack.savefields import GRAD_BATCH
from dampednewton.diagnostics import DiagnosticsMonitor
from dampednewton.diagnostics.draws import SeededDiagGGNMC
from dampednewton.diagnostics.log import Record


@dataclass(frozen=True)
class ActiveMonitor:
    """A diagnostics monitor scheduled at this step, and the step its record carries.

    Attributes:
        monitor: The monitor.
        step: The record's step: the optimizer's step calls so far.
        before: The monitor's :meth:`~DiagnosticsMonitor.snapshot` before the step.
    """

    monitor: DiagnosticsMonitor
    step: int
    before: tuple[int, list[Any], Any]

    @staticmethod
    def at(monitor: DiagnosticsMonitor | None, calls: int) -> ActiveMonitor | None:
        """The monitor if it is scheduled at step ``calls``, else ``None``."""
        if monitor is None or not monitor.is_active(calls):
            return None
        return ActiveMonitor(monitor, calls, monitor.snapshot())

    def rewind(self) -> None:
        """Undo the step's record and draws (a step that raised changes nothing)."""
        self.monitor.rewind(self.before)

    def finish(self, params: Iterable[Tensor], loss: Tensor) -> Record:
        """Assemble and log the step's record (:meth:`DiagnosticsMonitor.finish`)."""
        return self.monitor.finish(self.step, params, loss)


def with_monitor(
    extensions: list,
    hooks: list[Hook],
    active: ActiveMonitor,
    subsampling_grad: Sequence[int] | None,
) -> tuple[list, list[Hook]]:
    """Add the monitor's extensions and hook (first) to the step's backward pass.

    The monitor's individual gradients replace the structured ones of the step
    (which skip linear layers).

    Args:
        extensions: The step's extensions.
        hooks: The step's hooks (none: no refresh this step).
        active: The diagnostics monitor active this step.
        subsampling_grad: The step's sub-sampling of the gradients.

    Returns:
        The merged extensions and hooks.

    Raises:
        ValueError: For histograms with sub-sampled gradients.
    """
    merged = {extension.savefield: extension for extension in extensions}
    for extension in active.monitor.extensions(active.step):
        if extension.savefield == GRAD_BATCH and GRAD_BATCH in merged:
            if subsampling_grad is not None:
                raise ValueError(
                    "Diagnostics with individual gradients (histograms) need "
                    "subsampling_grad=None."
                )
            merged[GRAD_BATCH] = IndividualGradients()
        merged.setdefault(extension.savefield, extension)
    return list(merged.values()), [active.monitor.module_hook(active.step), *hooks]


@contextmanager
def checked_sampling(extensions: Iterable, deferred: DeferredChecks) -> Iterator[None]:
    """The monitor's Monte-Carlo traces sample inside the block as the step does.

    A non-finite model output is sampled as zeros and flagged in ``deferred``, so
    the step is refused (or skipped) as without the trace; outside the block (a
    standalone monitor) the traces sample what they get.

    Args:
        extensions: The pass's extensions.
        deferred: The step's deferred checks.

    Yields:
        Nothing; run the closure inside.
    """
    sampled = [e for e in extensions if isinstance(e, SeededDiagGGNMC)]
    for extension in sampled:
        extension.deferred_checks = deferred
    try:
        yield
    finally:
        for extension in sampled:
            extension.deferred_checks = None
