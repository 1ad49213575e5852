"""One group as its step sees it: typed options, averaged factor, frozen coefficients.

:func:`step_block` builds a group's :class:`StepBlock` at the start of a step; the
finisher (:mod:`dampednewton._step.group_step`) and the averaged step
(:mod:`dampednewton._step.averaged_step`) read its attributes.

The step's :class:`~dampednewton.computations.engine.GGNEngine` is shared with ViViT's
computation classes, whose groups are dicts: the block travels through it as the
single entry :data:`STEP_BLOCK` of the dict that :meth:`StepBlock.engine_group`
makes, and :func:`block_of` reads it back from the engine's block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from dampednewton._step.amortized import stored_frozen
from dampednewton._step.group_result import AveragedFactor
from dampednewton._step.options import GroupOptions
from dampednewton._step.records import FIRST_REFRESH, stored_factor
from dampednewton.computations.block import Block
from dampednewton.math.frozen_basis import FrozenBasis

STEP_BLOCK = "step_block"
"""The key of the engine group's dict that carries its :class:`StepBlock`."""


@dataclass(frozen=True, eq=False)  # eq=False: identity, tensors have no ``==``
class StepBlock:
    """A param group's parameters and what its step needs besides the batch.

    Attributes:
        params: The group's parameters.
        options: Its validated options (criterion, damping, ``φ``, complement,
            averaging, ``lr``, ``kl_clip``, …).
        factor: Its averaged factor so far (``None``: no averaging, or no update
            yet).
        frozen: The coefficients of its steps between refreshes (``None``: no
            refresh stored them yet).
    """

    params: tuple[Tensor, ...]
    options: GroupOptions
    factor: AveragedFactor | None = None
    frozen: FrozenBasis | None = None
    first_refresh: int = 0

    def refreshes(self, step: int) -> bool:
        """Whether this step refreshes the group's curvature (always unaveraged).

        Args:
            step: The step's index.

        Returns:
            ``True`` for a BackPACK pass over the group.
        """
        averaging = self.options.averaging
        updates = 0 if self.factor is None else self.factor.updates
        return averaging is None or averaging.refreshes(
            step - self.first_refresh, updates
        )

    def engine_group(self) -> dict[str, Any]:
        """The group as the engine takes it: ``params`` and :data:`STEP_BLOCK`."""
        return {"params": list(self.params), STEP_BLOCK: self}


def block_of(block: Block) -> StepBlock:
    """The :class:`StepBlock` an engine block was made from.

    Args:
        block: A block of the step's engine (its group from
            :meth:`StepBlock.engine_group`).

    Returns:
        The step block.
    """
    return block.group[STEP_BLOCK]


def step_block(
    group: dict[str, Any],
    options: GroupOptions,
    state: Mapping,
    stats: Sequence[dict[str, Any]] | None,
    index: int,
) -> StepBlock:
    """A group's :class:`StepBlock`, with its averaged factor and frozen coefficients.

    Args:
        group: The param group.
        options: Its validated options.
        state: The optimizer's state (the averaged basis per parameter).
        stats: The groups' statistics (``None`` before the first step).
        index: The group's index.

    Returns:
        The block.
    """
    factor = frozen = None
    first_refresh = 0
    if options.averaging is not None and stats:
        factor = stored_factor(state, stats[index], group)
        frozen = stored_frozen(stats[index])
        first_refresh = stats[index].get(FIRST_REFRESH, 0)
    return StepBlock(tuple(group["params"]), options, factor, frozen, first_refresh)
