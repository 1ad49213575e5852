"""Parameter groups of the computations: validated, identified, checked per batch."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor


def group_key(group: dict) -> tuple[int, ...]:
    """Identify a parameter group by the identities of its parameters.

    Args:
        group: Parameter group with a ``'params'`` entry.

    Returns:
        Tuple of ``id``s, stable across copies of the group dictionary.
    """
    return tuple(id(p) for p in group["params"])


def check_subsampling_in_range(
    indices: list[int] | None, batch_size: int, name: str
) -> None:
    """Check that sub-sampling indices exist in the current batch.

    Args:
        indices: Sample indices or ``None``.
        batch_size: Size of the current mini-batch.
        name: Argument name for the error message.

    Raises:
        IndexError: If an index is not smaller than the batch size.
    """
    if indices is not None and max(indices) >= batch_size:
        raise IndexError(
            f"{name} holds index {max(indices)} but the mini-batch has only "
            f"{batch_size} samples."
        )


def validate_param_groups(
    param_groups: Sequence[dict], required_keys: Iterable[str] = ()
) -> list[dict]:
    """Check parameter groups: required keys present, tensors only, no overlaps.

    Args:
        param_groups: Groups as for a ``torch.optim.Optimizer``; each group is one GGN
            block.
        required_keys: Keys every group needs besides ``'params'``.

    Returns:
        The groups with ``'params'`` normalized to a list.

    Raises:
        KeyError: If a group lacks a required key.
        TypeError: If ``'params'`` holds something other than tensors.
        ValueError: If a parameter belongs to more than one group or a group is empty.
    """
    if isinstance(param_groups, dict):
        raise TypeError("param_groups must be a list of dicts, got a single dict.")
    seen: dict[int, int] = {}
    normalized = []
    for index, group in enumerate(param_groups):
        for key in ("params", *required_keys):
            if key not in group:
                raise KeyError(
                    f"Parameter group {index} has no '{key}' entry; every group needs "
                    f"{['params', *required_keys]}."
                )
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        if not params:
            raise ValueError(f"Parameter group {index} has no parameters.")
        for param in params:
            if not isinstance(param, Tensor):
                raise TypeError(
                    f"Parameter group {index} holds a {type(param).__name__}; "
                    "'params' must contain tensors."
                )
            if id(param) in seen:
                where = (
                    f"twice in group {index}"
                    if seen[id(param)] == index
                    else f"in groups {seen[id(param)]} and {index}"
                )
                raise ValueError(
                    f"A parameter of shape {tuple(param.shape)} appears {where}; each "
                    "parameter may belong to one group (one GGN block), once."
                )
            seen[id(param)] = index
        normalized.append({**group, "params": params})
    return normalized
