"""A job's learning-rate schedule, the same for every optimizer.

The fair protocol keeps each optimizer's learning rate constant over the budget
(``lr_schedule: null``). ``lr_schedule: linear`` decays every param group's
learning rate linearly to zero at the last step, ``inverse_sqrt`` by
``(1 + t/horizon)^(-1/2)`` whatever the budget (``lr_schedule_horizon``), both through
``torch.optim``'s own ``LambdaLR`` (stepped after each optimizer step): they answer
how much of a method's final metric is the noise of its iterates at a constant
learning rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("linear", "inverse_sqrt")
"""The names ``lr_schedule`` takes besides ``null``."""


@dataclass(frozen=True)
class LinearDecay:
    """The factor ``1 − t/T`` of the initial learning rate after ``t`` of ``T`` steps.

    Attributes:
        steps: ``T``, the budget (≥ 1).
    """

    steps: int

    def __call__(self, step: int) -> float:
        """The factor after ``step`` optimizer steps (0 from step ``T`` on)."""
        return max(0.0, 1.0 - step / self.steps)


@dataclass(frozen=True)
class InverseSqrtDecay:
    """The factor ``(1 + t/h)^(-1/2)`` of the initial learning rate after ``t`` steps.

    Attributes:
        horizon: ``h`` (> 0), the steps after which the rate is ``1/√2`` of the first.
    """

    horizon: float

    def __call__(self, step: int) -> float:
        """The factor after ``step`` optimizer steps."""
        return 1.0 / math.sqrt(1.0 + step / self.horizon)


def lr_scheduler(
    name: str | None, optimizer: Optimizer, steps: int, horizon: float
) -> LambdaLR | None:
    """The scheduler of ``lr_schedule`` over a budget of ``steps`` steps.

    Args:
        name: ``None`` (constant learning rates) or one of :data:`SCHEDULES`.
        optimizer: The job's optimizer (each group's ``lr`` is the initial one).
        steps: The problem's step budget (``linear``).
        horizon: ``inverse_sqrt``'s ``h`` (> 0).

    Returns:
        The scheduler, ``None`` for constant learning rates.

    Raises:
        ValueError: For another name, or a horizon that is not positive.
    """
    if name is None:
        return None
    if name not in SCHEDULES:
        raise ValueError(
            f"lr_schedule must be null (constant learning rates) or one of "
            f"{', '.join(SCHEDULES)}, got {name!r}."
        )
    if name == "linear":
        return LambdaLR(optimizer, LinearDecay(steps))
    if not horizon > 0:
        raise ValueError(f"lr_schedule_horizon must be > 0, got {horizon!r}.")
    return LambdaLR(optimizer, InverseSqrtDecay(horizon))
