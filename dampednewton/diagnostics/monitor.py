"""Compute several diagnostics inside one BackPACK backward pass.

:class:`DiagnosticsMonitor` has three entry points per step:

1. :meth:`~DiagnosticsMonitor.extensions` — the BackPACK extensions the
   scheduled diagnostics need, one per type;
2. :meth:`~DiagnosticsMonitor.module_hook` — an ``extension_hook`` for
   ``backpack(...)`` that, as backward reaches each module, reduces the per-sample
   quantities of its parameters into small pieces. It never deletes BackPACK's
   attributes, so a hook chained after it (e.g. an optimizer's) still sees them;
3. :meth:`~DiagnosticsMonitor.finish` — assembles the record of the step from the
   pieces and ``p.grad``, moves it to the CPU and appends it to the log.

With any ``torch.optim`` optimizer use :meth:`~DiagnosticsMonitor.backward_context`,
which enters ``backpack`` with both, frees the quantities layer by layer and finishes
the record when it exits (``p.grad`` is complete then, and not yet changed by the
optimizer)::

    loss = loss_fn(model(X), y)
    with monitor.backward_context(step, loss):
        loss.backward()
    optimizer.step()  # monitor.log[-1] is the record of `step`

Calling :meth:`~DiagnosticsMonitor.finish` after the context is optional: it
re-assembles the record of that step for the parameters (and loss) it is given.

The model and the loss function must be extended with ``backpack.extend``, the
loss must use ``reduction="mean"``, and gradients must be zeroed before backward
(``p.grad`` is taken as the mini-batch gradient).

Under ``torch.distributed`` (``process_group``, by default the world group when it
is initialized, as for :class:`~dampednewton.DampedNewton`) the record is the one of
the global batch (the ranks' equal local batches concatenated), the same on every
rank: :meth:`~DiagnosticsMonitor.finish` exchanges the diagnostics' small sufficient
statistics (:mod:`~dampednewton.diagnostics.ranks`), and ``p.grad`` must then hold
the global batch's mean gradient (``DistributedDataParallel`` averages it in
backward; replicating by hand, average it and call ``finish`` again). Every rank
calls ``finish`` for the same steps; write the log from one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from backpack.extensions.backprop_extension import BackpropExtension
from torch import Tensor, nn

from dampednewton.backpack.backward import quiet_backward_hook_warning
from dampednewton.backpack.passes import backward_pass
from dampednewton.diagnostics.draws import monte_carlo_draws
from dampednewton.diagnostics.log import DiagnosticsLog, Record
from dampednewton.diagnostics.pending import (
    REPEATED_PARAMETER,
    FinishedStep,
    PendingStep,
)
from dampednewton.diagnostics.ranks import SINGLE_PROCESS, Ranks, global_batch
from dampednewton.diagnostics.reducer import (
    DiagnosticSpec,
    Reducer,
    quantities_batch_size,
    reducer_of,
    to_host,
)
from dampednewton.diagnostics.specs.histogram_reducer import HistogramReducer
from dampednewton.process_groups import resolve_process_group

_USAGE = (
    "Run loss.backward() inside `with monitor.backward_context(step):`, or pass "
    "monitor.extensions(step) and monitor.module_hook(step) to backpack(...)."
)


NamedParameters = Iterable[tuple[str, Tensor]] | Mapping[str, Tensor]
"""``model.named_parameters()`` or a mapping name → parameter."""


class DiagnosticsMonitor:
    """Runs a list of diagnostics in the backward pass and logs their records.

    Attributes:
        diagnostics: The diagnostic specs, in order.
        log: Records of the finished steps.
        communicator: The ranks' collectives, ``None`` for one process.
    """

    def __init__(
        self,
        diagnostics: Sequence[DiagnosticSpec],
        named_parameters: NamedParameters | None = None,
        log: DiagnosticsLog | None = None,
        process_group: Any = None,
        seed: int | None = None,
    ) -> None:
        """Create a monitor.

        Args:
            diagnostics: Diagnostic specs with distinct labels.
            named_parameters: ``model.named_parameters()`` or a mapping name →
                parameter, for readable per-parameter keys. Unnamed parameters are
                called ``param_i`` (``i``: position in the list given to
                :meth:`finish`).
            log: Log to append to; a new one by default.
            process_group: ``torch.distributed`` group of data parallelism whose
                global batch the records describe; ``None``: the world group when
                ``torch.distributed`` is initialized with more than one process,
                else a single process.
            seed: Seed of the Monte-Carlo traces' generator (``None``: derived
                from ``torch.initial_seed()``, rank 0's under data parallelism);
                neither it nor their draws touch torch's global random stream.

        Raises:
            ValueError: If there are no diagnostics, two share a label, or two
                Monte-Carlo traces ask for different numbers of samples.
            TypeError: If a diagnostic is not a spec (has no ``make_reducer``), or
                ``process_group`` is not a process group.
        """
        self.diagnostics = list(diagnostics)
        if not self.diagnostics:
            raise ValueError("DiagnosticsMonitor needs at least one diagnostic.")
        self._reducers = [reducer_of(spec) for spec in self.diagnostics]
        labels = [spec.label for spec in self.diagnostics]
        duplicates = sorted({label for label in labels if labels.count(label) > 1})
        if duplicates:
            raise ValueError(
                f"Diagnostics need distinct labels, {duplicates} occur more than "
                "once; pass label=... to tell them apart."
            )
        # Extensions are stateless between passes: build them once, not every step.
        self._extensions = {id(r): r.extensions() for r in self._reducers}
        if isinstance(named_parameters, Mapping):
            named_parameters = named_parameters.items()
        self._names = {id(p): name for name, p in (named_parameters or ())}
        self.log = DiagnosticsLog() if log is None else log
        self.communicator = resolve_process_group(process_group)
        self._draws = monte_carlo_draws(
            self._extensions.values(), seed, self.communicator
        )
        self._ranks: Ranks = self.communicator or SINGLE_PROCESS
        self._pending: PendingStep | None = None
        self._finished: FinishedStep | None = None

    @property
    def communication_bytes(self) -> float:
        """Payload bytes this rank received in the monitor's collectives so far.

        Counted as by :attr:`DampedNewton.communication_bytes
        <dampednewton.DampedNewton.communication_bytes>`; ``0.0`` for one process.
        """
        return 0.0 if self.communicator is None else self.communicator.bytes_received

    def state_dict(self) -> dict[str, Any]:
        """The histograms' network ranges and the traces' generator (not the log)."""
        ranges = {
            reducer.spec.label: reducer.network_ranges
            for reducer in self._reducers
            if isinstance(reducer, HistogramReducer)
        }
        draws = None if self._draws is None else self._draws.seeded.state_dict()
        return {"network_ranges": ranges, "monte_carlo": draws}

    def snapshot(self) -> tuple[int, list[Any], Any]:
        """The log's length, histogram ranges and draws, for :meth:`rewind`."""
        ranges = [getattr(r, "network_ranges", None) for r in self._reducers]
        draws = None if self._draws is None else self._draws.seeded.state_dict()
        return len(self.log), ranges, draws

    def rewind(self, snapshot: tuple[int, list[Any], Any]) -> None:
        """Undo the records (unwritten yet), ranges and draws since :meth:`snapshot`."""
        length, ranges, draws = snapshot
        self.log.truncate(length)
        for reducer, saved in zip(self._reducers, ranges, strict=True):
            if isinstance(reducer, HistogramReducer):
                reducer.network_ranges = saved
        if self._draws is not None:
            self._draws.seeded.load_state_dict(draws)
        self._pending = self._finished = None

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from a state saved by :meth:`state_dict`.

        Raises:
            ValueError: For the ranges of other histograms than this monitor's.
        """
        saved = dict(state_dict["network_ranges"])
        histograms = {
            reducer.spec.label: reducer
            for reducer in self._reducers
            if isinstance(reducer, HistogramReducer)
        }
        if set(saved) != set(histograms):
            raise ValueError(
                f"The state holds the ranges of the histograms {sorted(saved)}, this "
                f"monitor has {sorted(histograms)}: create it with the diagnostics "
                "of the saved run."
            )
        for label, reducer in histograms.items():
            reducer.resume_from(saved[label])
        draws = state_dict.get("monte_carlo")  # absent in earlier versions' states
        if self._draws is not None and draws is not None:
            self._draws.seeded.load_state_dict(draws)

    def is_active(self, step: int) -> bool:
        """Return whether any diagnostic is scheduled at ``step``.

        Args:
            step: Optimization step.

        Returns:
            ``True`` if at least one diagnostic runs.
        """
        return bool(self._active(step))

    def _active(self, step: int) -> list[Reducer]:
        return [r for r in self._reducers if r.spec.schedule(step)]

    def extensions(self, step: int) -> list[BackpropExtension]:
        """BackPACK extensions of the diagnostics scheduled at ``step``.

        Args:
            step: Optimization step.

        Returns:
            One extension instance per extension type (empty if none is scheduled).
        """
        unique: dict[type, BackpropExtension] = {}
        for reducer in self._active(step):
            for extension in self._extensions[id(reducer)]:
                unique.setdefault(type(extension), extension)
        return list(unique.values())

    def module_hook(self, step: int) -> Callable[[nn.Module], None]:
        """BackPACK ``extension_hook`` for the backward pass of ``step``.

        Calling this starts the step: pieces of an unfinished earlier step are
        dropped. The hook reads ``grad_batch``, ``sum_grad_squared`` and ``diag_*``
        of each module's own parameters and leaves them in place.

        Args:
            step: Optimization step.

        Returns:
            Function of a module, to run after BackPACK's extensions on it.
        """
        pending = PendingStep(step, self._active(step))
        if self._draws is not None:
            self._draws.step = step
        for reducer in pending.reducers:
            reducer.begin(self._ranks)
        self._pending = pending
        self._finished = None

        def hook(module: nn.Module) -> None:
            if not pending.reducers:
                return
            reached: list[Tensor] = []
            for param in module.parameters(recurse=False):
                batch_size = quantities_batch_size(module, param)
                if batch_size is None:
                    continue
                pending.reach(param, batch_size)
                reached.append(param)
                for reducer in pending.reducers:
                    reducer.reduce(param, batch_size)
            pending.reached.append(reached)

        return hook

    @contextmanager
    def backward_context(
        self, step: int, loss: Tensor | float | None = None
    ) -> Iterator[None]:
        """Context for ``loss.backward()`` that computes and logs the step's record.

        Enters ``backpack(*extensions(step), extension_hook=...)`` with the
        monitor's hook followed by one that deletes the requested BackPACK
        attributes, so per-sample tensors are freed layer by layer. When the
        backward pass inside succeeded, the record is finished as by
        ``finish(step, loss=loss)``: it covers the parameters the backward pass
        reached, and is ``monitor.log[-1]``. At unscheduled steps it does nothing.

        Args:
            step: Optimization step.
            loss: Mini-batch loss, stored as ``"loss"`` if given.

        Yields:
            Nothing; run the backward pass inside.

        Raises:
            RuntimeError: If BackPACK finds no back-propagated curvature because the
                loss function is not extended, or the record cannot be finished
                (see :meth:`finish`).
        """
        hook = self.module_hook(step)
        extensions = self.extensions(step)
        if not extensions:
            with quiet_backward_hook_warning():  # BackPACK's hooks fire, run nothing
                yield
            return
        try:
            with backward_pass(extensions, [hook]):
                yield
        except AssertionError as error:
            if "backpropagation quantity" not in str(error):
                raise
            raise RuntimeError(
                "BackPACK found no back-propagated curvature: extend the loss "
                "function too, e.g. loss_fn = backpack.extend(nn.CrossEntropyLoss())."
            ) from error
        self.finish(step, loss=loss)

    def finish(
        self,
        step: int,
        params: Iterable[Tensor] | None = None,
        loss: Tensor | float | None = None,
    ) -> Record:
        """Assemble, log and return the record of ``step``.

        :meth:`backward_context` calls this when it exits. Called again for that
        step (before the next monitored backward pass, with ``p.grad`` unchanged),
        it re-assembles the record for the given parameters and loss and replaces
        it in the log.

        Args:
            step: The step whose backward pass was monitored.
            params: Parameters to report (those without ``grad`` are skipped);
                ``None``: those the backward pass reached, in the model's order.
            loss: Mini-batch loss, stored as ``"loss"`` if given.

        Returns:
            The record: ``"step"``, ``"batch_size"``, optionally ``"loss"``, and
            the diagnostics' entries as Python scalars and NumPy arrays. Empty
            (and not logged) if no diagnostic is scheduled at ``step``. Under
            ``torch.distributed``: the global batch size, the ranks' mean loss and
            the global batch's diagnostics.

        Raises:
            RuntimeError: If the backward pass of ``step`` was not monitored, BackPACK
                recorded nothing (model or loss not extended), some parameter with
                a gradient has no BackPACK quantities, or the batch size is not
                consistent across layers (or ranks).
        """
        pending, self._pending = self._pending, None
        finished, self._finished = self._finished, None
        replaced = None
        if pending is None and finished is not None and finished.pending.step == step:
            pending, replaced = finished.pending, finished.index
        if pending is None or pending.step != step:
            if not self.is_active(step):
                return {}
            raise RuntimeError(f"No monitored backward pass for step {step}. {_USAGE}")
        if not pending.reducers:
            return {}
        if pending.repeated:
            raise RuntimeError(REPEATED_PARAMETER.format(step=step))
        if not pending.seen:
            raise RuntimeError(
                f"No BackPACK quantities were recorded at step {step}. Extend the "
                "model and the loss function with backpack.extend(...) before the "
                f"forward pass. {_USAGE}"
            )
        if len(pending.batch_sizes) != 1:
            raise RuntimeError(
                f"Layers saw different batch sizes {sorted(pending.batch_sizes)}; "
                "the diagnostics need one mini-batch per backward pass."
            )
        (local_batch_size,) = pending.batch_sizes
        if params is None:
            params = pending.reached_parameters()
        named = [
            (self._names.get(id(p), f"param_{i}"), p)
            for i, p in enumerate(params)
            if p.grad is not None
        ]
        if not named:
            raise RuntimeError(f"None of the parameters has a gradient at step {step}.")
        batch_size, mean_loss = global_batch(self._ranks, local_batch_size, loss)
        record: dict = {"step": step, "batch_size": batch_size}
        if mean_loss is not None:
            record["loss"] = mean_loss
        for reducer in pending.reducers:
            record.update(
                {
                    key: to_host(value)
                    for key, value in reducer.assemble(named, batch_size).items()
                }
            )
        if replaced is None:
            self.log.append(record)
            replaced = len(self.log) - 1
        else:
            self.log.replace(replaced, record)
        self._finished = FinishedStep(pending, replaced)
        return self.log[replaced]
