"""A job's learning-rate schedule, the same for every optimizer.

The fair protocol keeps each optimizer's learning rate constant over the budget
(``lr_schedule: null``). ``lr_schedule: linear`` decays every param group's
learning rate linearly to zero at the last step, through ``torch.optim``'s own
``LambdaLR`` (stepped after each optimizer step): the question it answers is how much
of a method's final metric is the noise of its iterates at a constant learning rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("linear",)
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


def lr_scheduler(name: str | None, optimizer: Optimizer, steps: int) -> LambdaLR | None:
    """The scheduler of ``lr_schedule`` over a budget of ``steps`` steps.

    Args:
        name: ``None`` (constant learning rates) or one of :data:`SCHEDULES`.
        optimizer: The job's optimizer (each group's ``lr`` is the initial one).
        steps: The problem's step budget.

    Returns:
        The scheduler, ``None`` for constant learning rates.

    Raises:
        ValueError: For another name.
    """
    if name is None:
        return None
    if name not in SCHEDULES:
        raise ValueError(
            f"lr_schedule must be null (constant learning rates) or one of "
            f"{', '.join(SCHEDULES)}, got {name!r}."
        )
    return LambdaLR(optimizer, LinearDecay(steps))
