"""Checks of a state dict's per-parameter state against the groups and records.

Each returns ``None`` for state that fits, else a sentence that says what is wrong:
entries of other optimizers or of no parameter, tensors of another model's shapes,
and state that the records say exists but is missing (``torch.distributed.checkpoint``
leaves out parameters that do not require gradients, and ``dcp.load`` fills only the
keys its template has).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from dampednewton._step.kronecker_moments import MOMENT_KEYS
from dampednewton._step.kronecker_state import (
    INPUT_FACTOR,
    LAYERS,
    OUTPUT_FACTOR,
    UPDATES,
    holder_index,
)
from dampednewton._step.kronecker_state import STATE_KEYS as KRONECKER_STATE_KEYS
from dampednewton._step.records import BASIS, GROUPS
from dampednewton._step.update import AVERAGED_STEPS, FAST_ITERATE, MOMENTUM

#: Per-parameter state entries DampedNewton writes (averaged basis, momentum buffer,
#: Schedule-Free's iterate and count, a Kronecker layer's factors and eigenpairs, the
#: noise filter's moments).
PARAMETER_STATE_KEYS = (
    frozenset({BASIS, MOMENTUM, FAST_ITERATE, AVERAGED_STEPS})
    | KRONECKER_STATE_KEYS
    | MOMENT_KEYS
)
#: What a Kronecker layer's first parameter holds after a refresh.
LAYER_KEYS = KRONECKER_STATE_KEYS
MISSING_HINT = (
    "torch.distributed.checkpoint leaves out the state of parameters that do not "
    "require gradients (unfreeze them before get_state_dict, or save with "
    "optimizer.state_dict() and torch.save), and dcp.load fills only the keys of "
    "its template (build it from an optimizer whose step used every layer)"
)


def foreign_entry_problem(
    state: Mapping[Any, Any], saved: Sequence[Mapping[str, Any]]
) -> str | None:
    """Entries that are no saved parameter's, or hold what DampedNewton never writes.

    The keys are torch's indices, or names where ``torch.distributed.checkpoint``
    loads (the groups' ``params`` list the same keys).
    """
    try:
        keys = {key for group in saved for key in group["params"]}
    except TypeError as error:
        return f"its groups' 'params' are not indices or names ({error})"
    for key, entry in state.items():
        if key not in keys:
            return (
                f"its state has the entry {key!r}, which is not in its groups' 'params'"
            )
        if not isinstance(entry, Mapping):
            return f"the state of parameter {key} is not a dict"
        foreign = sorted(set(entry) - PARAMETER_STATE_KEYS)
        if foreign:
            return (
                f"the state of parameter {key} has {foreign}, which DampedNewton "
                f"never writes (it writes {sorted(PARAMETER_STATE_KEYS)}): the state "
                "dict of another optimizer (e.g. Adam's exp_avg)?"
            )
        if not all(isinstance(value, Tensor) for value in entry.values()):
            return f"the state of parameter {key} holds a non-tensor"
    return None


def _fits(entry: Mapping[str, Any], param: Tensor) -> Tensor | None:
    """The first of a parameter's state tensors that does not fit its shape."""
    for key in (MOMENTUM, FAST_ITERATE):
        buffer = entry.get(key)
        if buffer is not None and buffer.shape != param.shape:
            return buffer
    basis = entry.get(BASIS)
    if basis is not None and basis.shape[1:] != param.shape:
        return basis
    output = entry.get(OUTPUT_FACTOR)
    if output is not None and output.shape[0] != param.shape[0]:
        return output
    inputs = entry.get(INPUT_FACTOR)
    fan_in = math.prod(param.shape[1:])  # 1 for a bias alone
    if inputs is not None and inputs.shape[0] not in (fan_in, fan_in + 1):
        return inputs
    return None


def shape_problem(
    state: Mapping[Any, Any],
    saved: Sequence[Mapping[str, Any]],
    param_groups: Sequence[Mapping[str, Any]],
) -> str | None:
    """State tensors that do not fit their parameter (another model's state)."""
    for index, (saved_group, group) in enumerate(zip(saved, param_groups, strict=True)):
        for key, param in zip(saved_group["params"], group["params"], strict=True):
            held = _fits(state.get(key, {}), param)
            if held is not None:
                return (
                    f"parameter {key} (group {index}) has shape {tuple(param.shape)}, "
                    f"but its state holds a tensor of shape {tuple(held.shape)}: the "
                    "state dict of another model? Load it into an optimizer of the "
                    "model it was saved with"
                )
    return None


def missing_state_problem(
    state: Mapping[Any, Any],
    saved: Sequence[Mapping[str, Any]],
    records: Mapping[str, Any],
) -> str | None:
    """State the records say exists but the state dict lacks.

    A Kronecker layer listed in its group's statistics holds its factors and
    eigenpairs on its first parameter; a Gram group with an averaged factor holds
    its basis on every parameter.
    """
    for index, (group, stats) in enumerate(
        zip(saved, records.get(GROUPS, [{}] * len(saved)), strict=True)
    ):
        params = group["params"]
        needed = [
            (params[holder_index(pair)], LAYER_KEYS) for pair in stats.get(LAYERS, ())
        ]
        if stats.get(UPDATES, 0) > 0 and "curvature_weights" in stats:
            needed += [(key, frozenset({BASIS})) for key in params]
        for key, keys in needed:
            absent = sorted(keys - set(state.get(key, {})))
            if absent:
                more = ", ..." if len(absent) > 2 else ""
                return (
                    f"its records show the curvature of group {index}, but the state "
                    f"of parameter {key!r} lacks {', '.join(absent[:2])}{more}: "
                    f"{MISSING_HINT}"
                )
    return None
