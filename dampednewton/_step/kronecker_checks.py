"""A Kronecker step's checks: one host read, what is not finite, the loss trigger.

:func:`read_checks` brings the loss, every group's slope (a non-finite gradient or
direction makes it non-finite), the hooks' deferred checks and the factors' finiteness
to the host in one transfer; :func:`refusal` says why a step is refused;
:func:`loss_rose` says whether a step between refreshes saw the loss rise enough to
refresh at the next one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from dampednewton._step.options import GroupOptions
from dampednewton._step.records import REFRESH_LOSS
from dampednewton.backpack.loss_checks import DeferredChecks, targets_error


class Sloped(Protocol):
    """A group step with a slope ``ḡᵀs``."""

    @property
    def slope(self) -> Tensor:
        """``ḡᵀs`` (0-dim)."""


def loss_rose(
    options: Sequence[GroupOptions], global_state: dict[str, Any], loss: float
) -> bool:
    """Whether the loss exceeds ``1 + loss_tolerance`` times the last refresh's."""
    tolerances = [
        option.averaging.loss_tolerance
        for option in options
        if option.averaging is not None and option.averaging.loss_tolerance is not None
    ]
    reference = global_state.get(REFRESH_LOSS)
    if not tolerances or reference is None:
        return False
    return loss > (1 + min(tolerances)) * reference


def read_checks(
    loss: Tensor,
    steps: Sequence[Sloped | None],
    deferred: DeferredChecks,
    factors_finite: Tensor | None,
) -> dict[str, Any]:
    """The loss, the groups' slopes and the checks in one host read.

    A non-finite gradient or direction makes a slope non-finite.
    """
    tensors = [loss.detach()]
    tensors += [
        loss.new_zeros(()) if result is None else result.slope for result in steps
    ]
    extra = [
        deferred.ignored_targets,
        deferred.model_output_finite,
        deferred.loss_unscaled,
        factors_finite,
    ]
    tensors += [t for t in extra if t is not None]
    # One stack (it promotes bools and counts to the floats' dtype), one cast, one
    # read; a tensor on another device (a model over several) is moved first.
    device = loss.device
    with torch.no_grad():
        stacked = torch.stack([_scalar_on(t, device) for t in tensors])
        values = stacked.to(torch.float64).tolist()
    count = len(steps)
    rest = values[1 + count :]
    ignored = rest.pop(0) if deferred.ignored_targets is not None else 0.0
    output_finite = rest.pop(0) if deferred.model_output_finite is not None else 1.0
    unscaled = rest.pop(0) if deferred.loss_unscaled is not None else 1.0
    finite = rest.pop(0) if factors_finite is not None else 1.0
    return {
        "loss": values[0],
        "slopes": values[1 : 1 + count],
        "ignored": int(ignored),
        "output_finite": bool(output_finite),
        "loss_unscaled": bool(unscaled),
        "factors_finite": bool(finite),
    }


def _scalar_on(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` as a 0-dim tensor on ``device`` (no operator where it is one)."""
    scalar = tensor if tensor.dim() == 0 else tensor.reshape(())
    return scalar if scalar.device == device else scalar.to(device)


def refusal(
    values: dict[str, Any], deferred: DeferredChecks, dampings: Sequence[float]
) -> str | None:
    """What is not finite about a step (``None``: nothing).

    Args:
        values: The step's host read (:func:`read_checks`).
        deferred: The checks the hooks left.
        dampings: Every group's ``δ``: an undamped group is named as the cause of a
            non-finite step.

    Returns:
        The reason, or ``None``.

    Raises:
        ValueError: For cross-entropy targets equal to ``ignore_index``.
    """
    if values["ignored"]:
        raise targets_error(values["ignored"], deferred)
    if not math.isfinite(values["loss"]):
        return f"the loss is {values['loss']}"
    if not values["output_finite"]:
        return (
            "the model output is not finite, so the loss Hessian cannot be sampled "
            "(Monte-Carlo GGN)"
        )
    if not values["factors_finite"]:
        return "the curvature (the layers' Kronecker factors) is not finite"
    if not all(math.isfinite(v) for v in values["slopes"]):
        undamped = [index for index, delta in enumerate(dampings) if delta == 0]
        if undamped:
            return (
                f"the damped Newton step is not finite: parameter group {undamped[0]}"
                " has damping=0, and its Kronecker factors can have zero eigenvalues "
                "(e.g. from fewer samples than a factor's dimension), whose "
                "directions get an infinite step. Use a damping > 0 (the default is "
                "3e-3)"
            )
        return "the damped Newton step is not finite"
    return None
