"""State that follows its parameters when the model changes dtype during training.

``model.to(torch.float64)`` (or back to float32) between steps converts the
parameters in place: the optimizer holds the same tensors, now of another dtype, but
its curvature state and momentum (per parameter in ``optimizer.state``, the Gram
basis' averaged factor and frozen basis in the group records) are still in the old
one, and the next refresh would mix the two. :class:`ParameterDtypes` notices the
change at the next step and converts that state to the dtype the optimizer computes
each parameter in (:func:`~dampednewton.math.precision.computation_dtype`: float32
for half precisions), as loading a checkpoint does (:func:`convert_group_records`
for the group records).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dampednewton.math.precision import computation_dtype


class ParameterDtypes:
    """The parameters' dtypes at the last step."""

    def __init__(self) -> None:
        """Know no dtypes yet (the first step only records them)."""
        self._dtypes: tuple[torch.dtype, ...] | None = None

    def follow(
        self,
        groups: Sequence[Mapping[str, Any]],
        state: MutableMapping[Any, dict[str, Any]],
        group_records: Sequence[dict[str, Any]],
    ) -> bool:
        """Convert the state if a parameter changed dtype since the last step.

        Args:
            groups: The param groups.
            state: The per-parameter state.
            group_records: Per group, its statistics (the Gram basis' factors).

        Returns:
            Whether the state was converted (caches of its tensors are stale).
        """
        dtypes = tuple(p.dtype for group in groups for p in group["params"])
        changed = self._dtypes is not None and dtypes != self._dtypes
        self._dtypes = dtypes
        if not changed:
            return False
        for group in groups:
            for param in group["params"]:
                if param in state:
                    dtype = computation_dtype(param.dtype)
                    state[param] = converted(state[param], dtype)
        convert_group_records(groups, group_records)
        return True


def convert_group_records(
    groups: Sequence[Mapping[str, Any]], group_records: Sequence[dict[str, Any]]
) -> None:
    """Put each group's recorded tensors in the dtype its first parameter computes in.

    The Gram basis keeps its averaged factor's weights and its frozen basis there.

    Args:
        groups: The param groups.
        group_records: Per group, its statistics (converted in place).
    """
    for group, stats in zip(groups, group_records, strict=False):
        if group["params"]:
            dtype = computation_dtype(group["params"][0].dtype)
            stats.update(converted(stats, dtype))


def converted(entries: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``entries`` with floating-point tensors (also in nested dicts) in ``dtype``."""
    return {
        name: (
            value.to(dtype)
            if isinstance(value, Tensor) and value.is_floating_point()
            else converted(value, dtype)
            if isinstance(value, dict)
            else value
        )
        for name, value in entries.items()
    }
