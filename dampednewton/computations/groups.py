"""Parameter groups at run time: their identity, and sub-sampling against the batch."""

from __future__ import annotations


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
