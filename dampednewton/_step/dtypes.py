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
        """Know no dtypes yet: the first step compares the state with them."""
        self._dtypes: tuple[torch.dtype, ...] | None = None

    def follow(
        self,
        groups: Sequence[Mapping[str, Any]],
        state: MutableMapping[Any, dict[str, Any]],
        group_records: Sequence[dict[str, Any]],
    ) -> bool:
        """Convert the state if a parameter's dtype is not the one it was kept for.

        After the first step (of this optimizer, or since a load or a copy) only a
        change of the parameters' dtypes makes it look at the state.

        Args:
            groups: The param groups.
            state: The per-parameter state.
            group_records: Per group, its statistics (the Gram basis' factors).

        Returns:
            Whether the state was converted (caches of its tensors are stale).
        """
        dtypes = tuple(p.dtype for group in groups for p in group["params"])
        if dtypes == self._dtypes:
            return False
        self._dtypes = dtypes
        changed = False
        for group in groups:
            for param in group["params"]:
                if param in state:
                    dtype = computation_dtype(param.dtype)
                    entries, moved = converted(state[param], dtype)
                    if moved:
                        state[param], changed = entries, True
        return convert_group_records(groups, group_records) or changed


def convert_group_records(
    groups: Sequence[Mapping[str, Any]], group_records: Sequence[dict[str, Any]]
) -> bool:
    """Put each group's recorded tensors in the dtype its first parameter computes in.

    The Gram basis keeps its averaged factor's weights and its frozen basis there.

    Args:
        groups: The param groups.
        group_records: Per group, its statistics (converted in place).

    Returns:
        Whether a tensor was converted.
    """
    changed = False
    for group, stats in zip(groups, group_records, strict=False):
        if group["params"]:
            dtype = computation_dtype(group["params"][0].dtype)
            entries, moved = converted(stats, dtype)
            if moved:
                stats.update(entries)
                changed = True
    return changed


def converted(
    entries: Mapping[str, Any], dtype: torch.dtype
) -> tuple[dict[str, Any], bool]:
    """``entries`` with floating-point tensors (also in nested dicts) in ``dtype``.

    Returns:
        The converted entries (the same tensors where they were in ``dtype``) and
        whether any tensor was converted.
    """
    result: dict[str, Any] = {}
    changed = False
    for name, value in entries.items():
        if isinstance(value, Tensor) and value.is_floating_point():
            result[name] = value.to(dtype)
            changed = changed or value.dtype != dtype
        elif isinstance(value, dict):
            result[name], moved = converted(value, dtype)
            changed = changed or moved
        else:
            result[name] = value
    return result, changed
