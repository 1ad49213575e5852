"""``optimizer.state``: per parameter only, as ``torch.optim`` has it.

A ``defaultdict(dict)`` keyed by parameters. A string key (the layout of earlier
versions kept ``state['global']`` and ``state['groups']``) is refused with where the
entry went, instead of creating an empty entry that later checkpoints would carry.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any


class ParameterState(defaultdict):
    """The per-parameter state; a missing string key raises ``KeyError`` with advice.

    Example:
        >>> state = ParameterState(dict)
        >>> try:
        ...     state["global"]
        ... except KeyError as error:
        ...     print("optimizer.records" in str(error))
        True
        >>> "global" in state
        False
    """

    def __missing__(self, key: Any) -> Any:
        """A new entry for a parameter; ``KeyError`` for a name."""
        if isinstance(key, str):
            raise KeyError(
                "optimizer.state is per parameter: the step counters and group "
                "statistics are in optimizer.records ('global', 'groups')"
            )
        return super().__missing__(key)
