"""State dicts: settings that cannot be pickled, and checks of a state dict to load.

:func:`check_state_dict` refuses, before anything is loaded, a state dict that is not
DampedNewton's for these parameter groups (another optimizer's such as Adam's, a
different number of groups or parameters, a missing or corrupted entry), with an error
that names what is wrong; the optimizer is left as it was.

Group settings that cannot be pickled (lambdas, local functions) in state dicts:

A lambda criterion or damping steps fine, but ``torch.save(optimizer.state_dict())``
would fail with pickle's "Can't pickle <function <lambda>>", which names neither the
group nor the setting. :meth:`DampedNewton.state_dict` therefore puts such a value into
an :class:`UnpicklableSetting`: in memory it travels as the value itself
(``load_state_dict``, ``copy.deepcopy``), and pickling it raises an error that names
the group, the key and the picklable alternatives.

Per-parameter tensors keep the dtype the optimizer computes in: torch's loader would
cast a half-precision model's float32 state to the model's dtype
(:func:`without_parameter_tensors`, :func:`restore_parameter_tensors`).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from dampednewton._step.kronecker_moments import MOMENT_KEYS
from dampednewton._step.kronecker_state import OUTPUT_FACTOR
from dampednewton._step.kronecker_state import STATE_KEYS as KRONECKER_STATE_KEYS
from dampednewton._step.records import BASIS, GLOBAL, GROUPS
from dampednewton._step.update import MOMENTUM
from dampednewton.math.precision import computation_dtype
from dampednewton.policies.basis import GramBasis

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


def with_basis(state_dict: Any) -> Any:
    """A state dict whose groups name their basis (a copy where one is added).

    State dicts saved before the Kronecker basis existed have no ``'basis'`` in their
    groups: they stepped along the Gram basis, which they keep.

    Args:
        state_dict: What was passed to ``DampedNewton.load_state_dict``.

    Returns:
        The state dict, with ``'basis': GramBasis()`` in groups that had none.
    """
    if not isinstance(state_dict, Mapping):
        return state_dict
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(group, Mapping) and "criterion" in group for group in groups
    ):
        return state_dict
    if all("basis" in group for group in groups):
        return state_dict
    return {
        **state_dict,
        "param_groups": [
            {"basis": GramBasis(), **group} if "basis" not in group else group
            for group in groups
        ],
    }


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


#: Per-parameter state entries DampedNewton writes (averaged basis, momentum buffer,
#: a Kronecker layer's factors and eigenpairs).
PARAMETER_STATE_KEYS = frozenset({BASIS, MOMENTUM}) | KRONECKER_STATE_KEYS | MOMENT_KEYS
#: The key of DampedNewton's records in each saved parameter group: the group's
#: statistics (``'group'``) and, in group 0, the step counters (``'global'``) and the
#: Monte-Carlo generator (``'generator'``). In the groups, not in ``'state'``, so that
#: ``'state'`` is keyed by parameters only, as ``torch.distributed.checkpoint``
#: requires; it keeps the groups' extra keys.
RECORDS_KEY = "dampednewton"
SAVE_HINT = (
    " Load the output of DampedNewton.state_dict() of an optimizer built on the same "
    "parameter groups (as many groups, as many parameters in each)."
)


class StateDictError(ValueError):
    """A state dict that ``DampedNewton.load_state_dict`` refuses (nothing loaded)."""


def _refuse(problem: str) -> StateDictError:
    return StateDictError(f"DampedNewton refused the state dict: {problem}.{SAVE_HINT}")


def _check_groups(saved: Any, param_groups: Sequence[Mapping[str, Any]]) -> None:
    """Same number of groups and parameters; every setting of DampedNewton present."""
    if not isinstance(saved, Sequence) or not all(
        isinstance(group, Mapping) for group in saved
    ):
        raise _refuse("'param_groups' must be a list of dicts")
    if len(saved) != len(param_groups):
        raise _refuse(
            f"it has {len(saved)} parameter group(s), this optimizer "
            f"{len(param_groups)}"
        )
    for index, (group, own) in enumerate(zip(saved, param_groups, strict=True)):
        params = group.get("params")
        if not isinstance(params, Sequence) or len(params) != len(own["params"]):
            count = len(params) if isinstance(params, Sequence) else "no"
            raise _refuse(
                f"its group {index} has {count} parameters, this optimizer's "
                f"{len(own['params'])}"
            )
        missing = sorted(set(own) - set(group))
        if missing:
            foreign = sorted(set(group) - set(own))
            raise _refuse(
                f"its group {index} lacks the setting(s) {missing}"
                + (
                    f" and has {foreign}, which DampedNewton does not: the state "
                    "dict of another optimizer (e.g. Adam's)?"
                    if foreign
                    else ""
                )
            )


def _check_records(records: Mapping[str, Any], num_groups: int) -> None:
    """The step counters and, when present, one statistics dict per group."""
    counters = records.get(GLOBAL)
    if not isinstance(counters, Mapping) or not all(
        isinstance(counters.get(key), int) for key in ("step", "skipped_steps")
    ):
        raise _refuse(
            f"the step counters (param group 0's '{RECORDS_KEY}' entry, "
            f"'{GLOBAL}') must be a dict of the integers 'step' and "
            f"'skipped_steps', got {counters!r}"
        )
    if GROUPS not in records and counters["step"] > 0:
        raise _refuse(
            f"its step counters count {counters['step']} steps, but its param groups' "
            f"'{RECORDS_KEY}' entries hold no group statistics ('group'). A "
            "torch.distributed.checkpoint template built from an optimizer that never "
            "stepped loads only the keys it has: take one step before building the "
            "template (get_state_dict), then dcp.load and set_state_dict"
        )
    stats = records.get(GROUPS, [{}] * num_groups)
    if (
        not isinstance(stats, Sequence)
        or len(stats) != num_groups
        or not all(isinstance(entry, Mapping) for entry in stats)
    ):
        raise _refuse(
            f"the group statistics (each param group's '{RECORDS_KEY}' entry, "
            f"'group') must be {num_groups} dicts, one per group"
        )


def _check_parameter_state(
    state: Mapping[Any, Any], saved: Sequence[Mapping[str, Any]]
) -> None:
    """Per-parameter entries: keys of the saved groups' parameters, own keys only.

    The keys are torch's indices, or names where ``torch.distributed.checkpoint``
    loads (the groups' ``params`` list the same keys).
    """
    try:
        keys = {key for group in saved for key in group["params"]}
    except TypeError as error:
        raise _refuse(
            f"its groups' 'params' are not indices or names ({error})"
        ) from error
    for key, entry in state.items():
        if key not in keys:
            raise _refuse(
                f"its state has the entry {key!r}, which is not in its groups' 'params'"
            )
        if not isinstance(entry, Mapping):
            raise _refuse(f"the state of parameter {key} is not a dict")
        foreign = sorted(set(entry) - PARAMETER_STATE_KEYS)
        if foreign:
            raise _refuse(
                f"the state of parameter {key} has {foreign}, which DampedNewton "
                f"never writes (it writes {sorted(PARAMETER_STATE_KEYS)}): the state "
                "dict of another optimizer (e.g. Adam's exp_avg)?"
            )
        if not all(isinstance(value, Tensor) for value in entry.values()):
            raise _refuse(f"the state of parameter {key} holds a non-tensor")


def _check_parameter_shapes(
    state: Mapping[Any, Any],
    saved: Sequence[Mapping[str, Any]],
    param_groups: Sequence[Mapping[str, Any]],
) -> None:
    """A parameter's momentum buffer and output factor fit the parameter's shape."""
    for index, (saved_group, group) in enumerate(zip(saved, param_groups, strict=True)):
        for key, param in zip(saved_group["params"], group["params"], strict=True):
            entry = state.get(key, {})
            buffer = entry.get(MOMENTUM)
            factor = entry.get(OUTPUT_FACTOR)
            if (buffer is not None and buffer.shape != param.shape) or (
                factor is not None and factor.shape[0] != param.shape[0]
            ):
                held = buffer.shape if buffer is not None else factor.shape
                raise _refuse(
                    f"parameter {key} (group {index}) has shape {tuple(param.shape)}, "
                    f"but its state holds a tensor of shape {tuple(held)}: the state "
                    "dict of another model? Load it into an optimizer of the model "
                    "it was saved with"
                )


def attach_records(
    state_dict: dict[str, Any], records: Mapping[str, Any], generator: Any
) -> None:
    """Put the records and the generator's state into a state dict's groups.

    Args:
        state_dict: A ``torch.optim`` state dict (its groups are changed in place).
        records: The optimizer's step counters and group statistics.
        generator: The Monte-Carlo generator's state.
    """
    stats = records.get(GROUPS)
    for index, group in enumerate(state_dict["param_groups"]):
        entry: dict[str, Any] = {} if stats is None else {"group": stats[index]}
        if index == 0:
            entry.update({GLOBAL: records[GLOBAL], "generator": generator})
        group[RECORDS_KEY] = entry


def split_records(state_dict: Any) -> tuple[Any, dict[str, Any], Any]:
    """The state dict without its records, the records and the generator's state.

    Also reads the layout of earlier versions, which kept the records in
    ``'state'`` (``'global'``, ``'groups'``) and the generator at the top level. What
    is not recognisably a state dict is returned as it is, for
    :func:`check_state_dict` to refuse.

    Args:
        state_dict: What was passed to ``DampedNewton.load_state_dict``.

    Returns:
        The state dict (a copy where records were taken out), the records (empty
        when none were found) and the generator's state (``None`` when absent).
    """
    if not isinstance(state_dict, Mapping):
        return state_dict, {}, None
    state_dict = dict(state_dict)
    generator = state_dict.pop(RECORDS_KEY, None)  # earlier versions: top level
    records: dict[str, Any] = {}
    state = state_dict.get("state")
    if isinstance(state, Mapping) and (GLOBAL in state or GROUPS in state):
        state = dict(state)
        records = {key: state.pop(key) for key in (GLOBAL, GROUPS) if key in state}
        state_dict["state"] = state
    groups = state_dict.get("param_groups")
    if isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups):
        entries = [group.get(RECORDS_KEY) for group in groups]
        state_dict["param_groups"] = [
            {key: value for key, value in group.items() if key != RECORDS_KEY}
            for group in groups
        ]
        if entries and isinstance(entries[0], Mapping):
            records.setdefault(GLOBAL, entries[0].get(GLOBAL))
            generator = entries[0].get("generator", generator)
        stats = [entry.get("group") for entry in entries if isinstance(entry, Mapping)]
        if stats and any(entry is not None for entry in stats):
            records.setdefault(GROUPS, stats)
    return state_dict, records, generator


def check_state_dict(
    state_dict: Any,
    records: Mapping[str, Any],
    generator: Any,
    param_groups: Sequence[Mapping[str, Any]],
) -> None:
    """Check that ``state_dict`` is DampedNewton's, for these groups, before loading.

    Args:
        state_dict: What was passed to ``DampedNewton.load_state_dict``, without its
            records (:func:`split_records`).
        records: Its step counters and group statistics.
        generator: Its Monte-Carlo generator's state (``None`` when absent).
        param_groups: The optimizer's own parameter groups.

    Raises:
        StateDictError: If it is not a dict with ``'state'`` and ``'param_groups'``,
            has another number of groups or of parameters in a group, lacks a
            DampedNewton setting in a group (another optimizer's groups), holds
            per-parameter entries DampedNewton never writes (Adam's ``exp_avg``),
            lacks the step counters, has a malformed generator state, or holds
            state of another shape than a parameter's (another model).
    """
    if not isinstance(state_dict, Mapping):
        raise _refuse(f"expected a dict, got {type(state_dict).__name__}")
    missing = [key for key in ("state", "param_groups") if key not in state_dict]
    if missing:
        raise _refuse(f"it lacks the key(s) {missing}")
    _check_groups(state_dict["param_groups"], param_groups)
    state = state_dict["state"]
    if not isinstance(state, Mapping):
        raise _refuse("'state' must be a dict")
    _check_records(records, len(param_groups))
    _check_parameter_state(state, state_dict["param_groups"])
    _check_parameter_shapes(state, state_dict["param_groups"], param_groups)
    if generator is not None and not (
        isinstance(generator, Mapping) and {"seed", "generator"} <= set(generator)
    ):
        raise _refuse(
            f"the generator state (param group 0's '{RECORDS_KEY}' entry) must hold "
            "'seed' and 'generator'"
        )


def without_parameter_tensors(
    state_dict: dict[str, Any],
) -> tuple[dict[str, Any], dict[Any, dict[str, Tensor]]]:
    """The state dict without its per-parameter floating tensors, and those tensors.

    ``torch.optim.Optimizer.load_state_dict`` casts every floating tensor of a
    parameter's state to the parameter's dtype: a bfloat16 model's float32 factors,
    eigenvectors, momentum and moments would come back rounded to bfloat16 (and the
    next refresh would mix dtypes). :func:`restore_parameter_tensors` puts them back
    in the dtype the optimizer computes in.

    Args:
        state_dict: A validated state dict (``check_state_dict``).

    Returns:
        The state dict to hand to torch, and per saved parameter key its tensors.
    """
    kept: dict[Any, dict[str, Tensor]] = {}
    state = {}
    for key, entry in state_dict["state"].items():
        if isinstance(entry, Mapping):
            tensors = {
                name: value
                for name, value in entry.items()
                if isinstance(value, Tensor) and value.is_floating_point()
            }
            kept[key] = tensors
            entry = {name: v for name, v in entry.items() if name not in tensors}
        state[key] = entry
    return {**state_dict, "state": state}, kept


def restore_parameter_tensors(
    state: Any,
    saved_groups: Sequence[Mapping[str, Any]],
    param_groups: Sequence[Mapping[str, Any]],
    kept: Mapping[Any, Mapping[str, Tensor]],
) -> None:
    """Put :func:`without_parameter_tensors`' tensors back, copied to the device.

    Each goes to its parameter's device in the dtype the optimizer computes that
    parameter's curvature and momentum in (float32 for half precisions).

    Args:
        state: The optimizer's state after torch's ``load_state_dict``.
        saved_groups: The saved param groups (their ``params`` are indices).
        param_groups: The optimizer's param groups.
        kept: Per saved parameter key, its tensors.
    """
    params = {
        index: param
        for saved, group in zip(saved_groups, param_groups, strict=True)
        for index, param in zip(saved["params"], group["params"], strict=True)
    }
    for index, tensors in kept.items():
        param = params[index]
        dtype = computation_dtype(param.dtype)
        state[param].update(
            {
                name: value.to(device=param.device, dtype=dtype, copy=True)
                for name, value in tensors.items()
            }
        )
