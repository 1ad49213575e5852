"""Group settings that cannot be pickled (lambdas, local functions) in state dicts.

A lambda criterion or damping steps fine, but ``torch.save(optimizer.state_dict())``
would fail with pickle's "Can't pickle <function <lambda>>", which names neither the
group nor the setting. :meth:`DampedNewton.state_dict` therefore puts such a value into
an :class:`UnpicklableSetting`: in memory it travels as the value itself
(``load_state_dict``, ``copy.deepcopy``), and pickling it raises an error that names
the group, the key and the picklable alternatives.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

PICKLABLE_ALTERNATIVES = {
    "criterion": "TopK(k), EigenvalueThreshold(v) or RelativeThreshold(f)",
    "damping": (
        "a number, ConstantDamping, LevenbergMarquardt, NoiseAwareDamping, "
        "GSNRDamping or RelativeDamping"
    ),
    "complement": "a number, SmallestCurvature() or ConstantCurvature(rho)",
}


@dataclass(frozen=True)
class UnpicklableSetting:
    """A group setting kept by reference in a state dict; refuses to be pickled.

    Attributes:
        value: The setting itself (e.g. a lambda).
        group: Index of its parameter group.
        key: Its key in the group.
        reason: Pickle's own error message.
    """

    value: Any
    group: int
    key: str
    reason: str = field(compare=False)

    def __reduce__(self):
        """Refuse pickling with a message that says what to do.

        Raises:
            pickle.PicklingError: Always.
        """
        alternatives = PICKLABLE_ALTERNATIVES.get(self.key, "a picklable object")
        raise pickle.PicklingError(
            f"DampedNewton's parameter group {self.group} has {self.key}="
            f"{self.value!r}, which cannot be pickled ({self.reason}), so this state "
            "dict cannot be saved (stepping and in-memory load_state_dict are not "
            f"affected). To save checkpoints, use {alternatives}, or a function or "
            "class defined at module level instead of a lambda or local function."
        )

    def __copy__(self) -> UnpicklableSetting:
        """The setting itself (copies share the value, as for functions)."""
        return self

    def __deepcopy__(self, memo: dict) -> UnpicklableSetting:
        """The setting itself (copies share the value, as for functions)."""
        return self


def mark_unpicklable(groups: list[dict[str, Any]]) -> None:
    """Wrap, in place, every setting of state-dict groups that cannot be pickled.

    Args:
        groups: The ``param_groups`` of a state dict (not the optimizer's own).
    """
    for index, group in enumerate(groups):
        for key, value in group.items():
            if key == "params":
                continue
            try:
                pickle.dumps(value)
            except (pickle.PicklingError, AttributeError, TypeError) as error:
                group[key] = UnpicklableSetting(value, index, key, str(error))


def unwrap_settings(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """State-dict groups with every :class:`UnpicklableSetting` replaced by its value.

    Args:
        groups: The ``param_groups`` of a state dict.

    Returns:
        New group dicts (the input is left as it is).
    """
    return [
        {
            key: value.value if isinstance(value, UnpicklableSetting) else value
            for key, value in group.items()
        }
        for group in groups
    ]
