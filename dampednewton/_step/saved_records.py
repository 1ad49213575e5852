"""Where a state dict keeps DampedNewton's records: in its param groups.

The records are the step counters (``records['global']``) and each group's
statistics (``records['groups'][i]``, see :mod:`._step.records`), with the
Monte-Carlo generator's state. They are not per parameter, and
``torch.distributed.checkpoint`` requires ``state_dict()['state']`` keyed by
parameters only (it maps each key to a parameter's name); it keeps the groups' extra
keys, so the records travel there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dampednewton._step.records import GLOBAL, GROUPS

#: The key of DampedNewton's records in each saved parameter group: the group's
#: statistics (``'group'``) and, in group 0, the step counters (``'global'``) and the
#: Monte-Carlo generator (``'generator'``). In the groups, not in ``'state'``, so that
#: ``'state'`` is keyed by parameters only, as ``torch.distributed.checkpoint``
#: requires; it keeps the groups' extra keys.
RECORDS_KEY = "dampednewton"


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
    legacy: dict[str, Any] = {}
    state = state_dict.get("state")
    if isinstance(state, Mapping) and (GLOBAL in state or GROUPS in state):
        state = dict(state)
        legacy = {key: state.pop(key) for key in (GLOBAL, GROUPS) if key in state}
        state_dict["state"] = state
    records: dict[str, Any] = {}
    groups = state_dict.get("param_groups")
    if isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups):
        entries = [group.get(RECORDS_KEY) for group in groups]
        state_dict["param_groups"] = [
            {key: value for key, value in group.items() if key != RECORDS_KEY}
            for group in groups
        ]
        if entries and isinstance(entries[0], Mapping) and GLOBAL in entries[0]:
            records[GLOBAL] = entries[0][GLOBAL]
            generator = entries[0].get("generator", generator)
            stats = [e.get("group") for e in entries if isinstance(e, Mapping)]
            if any(entry is not None for entry in stats):
                records[GROUPS] = stats
    # The groups' records win over stray entries of the earlier layout's keys.
    return state_dict, records or legacy, generator


def records_problem(records: Mapping[str, Any], num_groups: int) -> str | None:
    """What is wrong with a state dict's records, if anything.

    Args:
        records: The records (:func:`split_records`).
        num_groups: The optimizer's number of param groups.

    Returns:
        ``None`` for step counters and, when present, one statistics dict per group;
        else a sentence that says what is wrong.
    """
    counters = records.get(GLOBAL)
    if counters is None:
        return (
            f"it holds no step counters (param group 0's '{RECORDS_KEY}' entry): the "
            "state dict of another optimizer, or one from torch.distributed.checkpoint "
            "with flatten_optimizer_state_dict=True, which drops the groups' records "
            "(use its default StateDictOptions)"
        )
    if not isinstance(counters, Mapping) or not all(
        isinstance(counters.get(key), int) for key in ("step", "skipped_steps")
    ):
        return (
            f"the step counters (param group 0's '{RECORDS_KEY}' entry, "
            f"'{GLOBAL}') must be a dict of the integers 'step' and "
            f"'skipped_steps', got {counters!r}"
        )
    if GROUPS not in records and counters["step"] > 0:
        return (
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
        return (
            f"the group statistics (each param group's '{RECORDS_KEY}' entry, "
            f"'group') must be {num_groups} dicts, one per group"
        )
    return None
