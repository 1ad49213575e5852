"""State dicts: their layout, and checks of a state dict before it is loaded.

``state_dict()['state']`` is keyed by parameters only, as
``torch.distributed.checkpoint`` requires; DampedNewton's records (step counters,
group statistics, the Monte-Carlo generator) travel in the param groups
(:mod:`._step.saved_records`, which also reads the earlier layout).

:func:`checked_state_dict` refuses, before anything is loaded, a state dict that is
not DampedNewton's for these parameter groups (another optimizer's such as Adam's, a
different number of groups or parameters, a missing or corrupted entry), with an error
that names what is wrong; the optimizer is left as it was.

Per-parameter tensors keep the dtype the optimizer computes in: torch's loader would
cast a half-precision model's float32 state to the model's dtype
(:func:`checked_state_dict` takes them out, :func:`restore_parameter_tensors` puts
them back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any, NamedTuple

from torch import Tensor

from dampednewton._step.options import GroupOptions
from dampednewton._step.saved_records import (
    RECORDS_KEY,
    records_problem,
    split_records,
)
from dampednewton._step.saved_state_checks import (
    foreign_entry_problem,
    missing_state_problem,
    shape_problem,
)
from dampednewton._step.unpicklable import unwrap_settings
from dampednewton.math.precision import computation_dtype
from dampednewton.policies.basis import GramBasis


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


SAVE_HINT = (
    " Load the output of DampedNewton.state_dict() of an optimizer built on the same "
    "parameter groups (as many groups, as many parameters in each)."
)


class StateDictError(ValueError):
    """A state dict that ``DampedNewton.load_state_dict`` refuses (nothing loaded)."""


def _refuse(problem: str) -> StateDictError:
    return StateDictError(f"DampedNewton refused the state dict: {problem}.{SAVE_HINT}")


def _check_groups(
    saved: Any, param_groups: Sequence[Mapping[str, Any]], hyperparameters: Set[str]
) -> None:
    """Same number of groups and parameters; every hyperparameter present.

    Other keys of the optimizer's groups (a user's, a scheduler's ``initial_lr``)
    need not be in the saved ones: as in ``torch.optim``, the saved groups replace
    them.
    """
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
        missing = sorted((set(own) & hyperparameters) - set(group))
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


def check_state_dict(
    state_dict: Any,
    records: Mapping[str, Any],
    generator: Any,
    param_groups: Sequence[Mapping[str, Any]],
    hyperparameters: Set[str],
) -> None:
    """Check that ``state_dict`` is DampedNewton's, for these groups, before loading.

    Args:
        state_dict: What was passed to ``DampedNewton.load_state_dict``, without its
            records (:func:`split_records`).
        records: Its step counters and group statistics.
        generator: Its Monte-Carlo generator's state (``None`` when absent).
        param_groups: The optimizer's own parameter groups.
        hyperparameters: The optimizer's hyperparameters (its defaults' keys).

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
    _check_groups(state_dict["param_groups"], param_groups, hyperparameters)
    state = state_dict["state"]
    if not isinstance(state, Mapping):
        raise _refuse("'state' must be a dict")
    problem = records_problem(records, len(param_groups))
    if problem is not None:
        raise _refuse(problem)
    saved = state_dict["param_groups"]
    for problem in (
        foreign_entry_problem(state, saved),
        shape_problem(state, saved, param_groups),
        missing_state_problem(state, saved, records),
    ):
        if problem is not None:
            raise _refuse(problem)
    if generator is not None and not (
        isinstance(generator, Mapping) and {"seed", "generator"} <= set(generator)
    ):
        raise _refuse(
            f"the generator state (param group 0's '{RECORDS_KEY}' entry) must hold "
            "'seed' and 'generator'"
        )


class CheckedStateDict(NamedTuple):
    """A state dict checked for these groups, in the parts ``load_state_dict`` sets.

    Attributes:
        for_torch: What ``torch.optim.Optimizer.load_state_dict`` loads: groups
            with their settings unwrapped, per-parameter state without its floating
            tensors.
        tensors: Per saved parameter key, its floating tensors
            (:func:`restore_parameter_tensors`).
        records: The step counters and group statistics.
        generator: The Monte-Carlo generator's state (``None`` when absent).
    """

    for_torch: dict[str, Any]
    tensors: dict[Any, dict[str, Tensor]]
    records: dict[str, Any]
    generator: Any


def checked_state_dict(
    state_dict: Any,
    param_groups: Sequence[Mapping[str, Any]],
    hyperparameters: Set[str],
) -> CheckedStateDict:
    """Check a state dict for these groups and split it for loading.

    Args:
        state_dict: What was passed to ``DampedNewton.load_state_dict``.
        param_groups: The optimizer's own parameter groups.
        hyperparameters: The optimizer's hyperparameters (its defaults' keys).

    Returns:
        Its parts.

    Raises:
        StateDictError: See :func:`check_state_dict`.
        ValueError: For an invalid setting in a saved group.
        TypeError: For a setting of the wrong type in a saved group.
    """
    state_dict, records, generator = split_records(with_basis(state_dict))
    check_state_dict(state_dict, records, generator, param_groups, hyperparameters)
    state_dict["param_groups"] = unwrap_settings(state_dict["param_groups"])
    for group in state_dict["param_groups"]:
        GroupOptions.from_group(group)
    for_torch, tensors = without_parameter_tensors(state_dict)
    return CheckedStateDict(for_torch, tensors, records, generator)


def shared_defaults(
    defaults: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]]
) -> dict[str, int]:
    """The defaults that are a group's own object (not a number): key → group index.

    A group takes the constructor's policy objects themselves (an adaptive damping
    adapts for every group that shares it, and for groups added later). Loading a
    state dict gives the groups copies; pointing these defaults at the copies keeps
    a group added after the load sharing them, as it would have without the load.

    Args:
        defaults: The optimizer's defaults.
        param_groups: Its groups before the load.

    Returns:
        Per such default, the first group holding it.
    """
    shared = {}
    for key, value in defaults.items():
        if isinstance(value, bool | int | float | str | type(None)):
            continue
        holders = [i for i, group in enumerate(param_groups) if group.get(key) is value]
        if holders:
            shared[key] = holders[0]
    return shared


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
