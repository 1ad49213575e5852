"""The single backward pass of a step: its computation, extensions and hook.

:class:`StepPass` keeps the step's :class:`~dampednewton.group_step.StepComputation`
and its BackPACK extensions while the settings that shape them hold, adds the
diagnostics monitor's extensions and hook to the same pass (:func:`with_monitor`),
and runs the closure inside that pass under the one-backward check
(:func:`run_closure`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from backpack import backpack
from torch import Generator, Tensor

from dampednewton.backpack.extensions import IndividualGradients, NonFiniteModelOutput
from dampednewton.backpack.passes import chained
from dampednewton.backpack.savefields import GRAD_BATCH
from dampednewton.backward import SingleBackwardCheck, quiet_backward_hook_warning
from dampednewton.diagnostics import DiagnosticsMonitor
from dampednewton.group_step import (
    AveragedFactor,
    GroupStep,
    StepComputation,
    averaged_step,
)
from dampednewton.options import GroupOptions, SharedOptions
from dampednewton.records import stored_factor

CLOSURE_PATTERN = """\
    def closure():
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss

    loss = optimizer.step(closure)"""

Hook = Callable[[torch.nn.Module], None]


class StepPass:
    """The step's computation and extensions, rebuilt only when settings change."""

    def __init__(self) -> None:
        """Start without a computation."""
        self._cached: tuple[tuple, StepComputation, list] | None = None

    def clear(self) -> None:
        """Forget the computation (after loading a state)."""
        self._cached = None

    def run(
        self,
        closure: Callable[[], Tensor],
        blocks: list[dict[str, Any]],
        shared: SharedOptions,
        *,
        per_sample_gradients: bool,
        generator: Generator | None,
        monitor: DiagnosticsMonitor | None,
        step: int,
    ) -> tuple[Tensor, list[GroupStep | None], bool]:
        """Run the closure's one backward pass and compute every group's direction.

        Groups whose averaged factor is not refreshed this step reuse it; when no
        group refreshes and no monitor is active, the closure runs without BackPACK
        extensions.

        Args:
            closure: ``zero_grad``, forward, ``backward``; returns the loss.
            blocks: Per group, the group as the computation sees it (``params``,
                policies, ``averaging`` and its ``factor``).
            shared: The options of the backward pass.
            per_sample_gradients: Whether a damping policy needs per-sample slopes.
            generator: The Monte-Carlo generator, or ``None``.
            monitor: The diagnostics monitor if it is active this step.
            step: The step's index.

        Returns:
            The loss, every group's step (``None``: no trainable parameter), and
            whether every group's curvature was finite.
        """
        refreshing = [
            block["averaging"] is None
            or block["averaging"].refreshes(step, _updates(block["factor"]))
            for block in blocks
        ]
        computation, extensions, hook = None, [], None
        if any(refreshing):
            computation, extensions = self.get(shared, per_sample_gradients, generator)
            hook = computation.get_extension_hook(
                [b for b, refresh in zip(blocks, refreshing, strict=True) if refresh]
            )
        if monitor is not None:
            extensions, hook = with_monitor(
                extensions, hook, monitor, step, shared.subsampling_grad
            )
        params = [p for block in blocks for p in block["params"]]
        try:
            loss = run_closure(closure, params, extensions, hook)
            with torch.no_grad():
                results = [
                    _result(computation, block)
                    if refresh
                    else averaged_step(block, block["factor"])
                    for block, refresh in zip(blocks, refreshing, strict=True)
                ]
        except NonFiniteModelOutput:
            # Raised inside backward, before the closure could return its loss.
            return torch.tensor(math.nan), [None] * len(blocks), True
        finite = computation is None or computation.curvature_finite
        return loss, results, finite

    def get(
        self,
        shared: SharedOptions,
        per_sample_gradients: bool,
        generator: Generator | None,
    ) -> tuple[StepComputation, list]:
        """The computation (reset for a new step) and its BackPACK extensions.

        Args:
            shared: The options of the backward pass.
            per_sample_gradients: Whether a damping policy needs per-sample slopes.
            generator: The Monte-Carlo generator, or ``None`` for the exact GGN.

        Returns:
            The computation and its extensions.
        """
        key = (
            per_sample_gradients,
            shared.mc_samples,
            tuple(shared.subsampling_ggn or ()),
            tuple(shared.subsampling_grad or ()),
            id(generator),
        )
        if self._cached is None or self._cached[0] != key:
            computation = StepComputation(
                subsampling_grad=shared.subsampling_grad,
                subsampling_ggn=shared.subsampling_ggn,
                mc_samples_ggn=shared.mc_samples,
                warn_small_eigvals=0,  # the optimizer warns, once per group
                generator=generator,
                per_sample_gradients=per_sample_gradients,
            )
            self._cached = (key, computation, computation.get_extensions())
        computation = self._cached[1]
        computation.curvature_finite = True
        return computation, self._cached[2]


def with_monitor(
    extensions: list,
    hook: Hook | None,
    monitor: DiagnosticsMonitor,
    step: int,
    subsampling_grad: Sequence[int] | None,
) -> tuple[list, Hook]:
    """Add the monitor's extensions and hook (first) to the step's backward pass.

    The monitor's individual gradients replace the structured ones of the step
    (which skip linear layers); all BackPACK buffers are freed layer by layer.

    Args:
        extensions: The step's extensions.
        hook: The step's hook, or ``None`` (no refresh this step).
        monitor: The diagnostics monitor, active at ``step``.
        step: The step's index.
        subsampling_grad: The step's sub-sampling of the gradients.

    Returns:
        The merged extensions and hook.

    Raises:
        ValueError: For histograms with sub-sampled gradients.
    """
    merged = {extension.savefield: extension for extension in extensions}
    for extension in monitor.extensions(step):
        if extension.savefield == GRAD_BATCH and GRAD_BATCH in merged:
            if subsampling_grad is not None:
                raise ValueError(
                    "Diagnostics with individual gradients (histograms) need "
                    "subsampling_grad=None."
                )
            merged[GRAD_BATCH] = IndividualGradients()
        merged.setdefault(extension.savefield, extension)
    return list(merged.values()), chained([monitor.module_hook(step), hook], merged)


def run_closure(
    closure: Callable[[], Any],
    params: Sequence[Tensor],
    extensions: list,
    hook: Hook | None,
) -> Any:
    """Run the closure's backward pass with the extensions (if any) and the hook.

    Args:
        closure: ``zero_grad``, forward, ``backward``; returns the loss.
        params: Every parameter of the optimizer.
        extensions: BackPACK extensions; none: a plain backward pass.
        hook: BackPACK's extension hook.

    Returns:
        What the closure returned.

    Raises:
        RuntimeError: When the closure ran several backward passes or did not zero
            the gradients.
    """
    with (
        torch.enable_grad(),
        quiet_backward_hook_warning(),
        SingleBackwardCheck(params) as check,
    ):
        if extensions:
            with backpack(*extensions, extension_hook=hook):
                loss = closure()
        else:
            loss = closure()
    problem = check.problem()
    if problem is not None:
        raise RuntimeError(
            f"DampedNewton refused the step: {problem}; parameters and optimizer "
            f"state unchanged. The closure should be\n{CLOSURE_PATTERN}"
        )
    return loss


def step_block(
    group: dict[str, Any], options: GroupOptions, state: Mapping, index: int
) -> dict[str, Any]:
    """A group as the step computation sees it, with its averaged factor.

    Args:
        group: The param group.
        options: Its validated options.
        state: The optimizer's state (``state['groups'][index]`` holds the
            group's statistics once it stepped).
        index: The group's index.

    Returns:
        The block: ``params``, the policies, ``averaging`` and ``factor``.
    """
    stats = state.get("groups")
    factor = None
    if options.averaging is not None and stats:
        factor = stored_factor(state, stats[index], group)
    return {
        "params": group["params"],
        "criterion": options.criterion,
        "damping": options.damping,
        "complement": options.complement,
        "averaging": options.averaging,
        "factor": factor,
    }


def _result(computation: StepComputation, block: dict) -> GroupStep | None:
    """A group's step from the computation (``None`` without trainable parameters).

    Raises:
        RuntimeError: When no curvature reached the group's parameters.
    """
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


def _updates(factor: AveragedFactor | None) -> int:
    return 0 if factor is None else factor.updates
