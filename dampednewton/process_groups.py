"""Which process group an optimizer or a monitor serves, and when it was resolved.

``process_group=None`` means the ``torch.distributed`` world group when it is
initialized, else a single process (no :class:`~dampednewton.distributed.Communicator`);
an optimizer created before ``init_process_group`` is refused when it steps under
several processes.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dampednewton.distributed import Communicator


def world_initialized() -> bool:
    """Whether ``torch.distributed`` is available and initialized."""
    return dist.is_available() and dist.is_initialized()


def check_created_after_init(before_init: bool) -> None:
    """Refuse to step alone an optimizer made before ``init_process_group``.

    Its default process group (``None``: the world group when initialized) was
    resolved when it was created, to a single process; stepping each rank on its
    own batch would let the replicas drift apart silently.

    Args:
        before_init: Whether it was created with the default group before
            ``torch.distributed`` was initialized.

    Raises:
        RuntimeError: If ``torch.distributed`` now runs several processes.
    """
    if before_init and world_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "DampedNewton was created before torch.distributed.init_process_group, "
            "so it would step each rank on its own batch (the replicas drift apart). "
            "Create it after init_process_group: it then takes the global batch's "
            "step on every rank."
        )


def resolve_process_group(process_group: Any) -> Communicator | None:
    """The communicator of ``process_group``, or ``None`` for a single process.

    Args:
        process_group: A ``torch.distributed`` process group, or ``None`` for the
            world group when ``torch.distributed`` is initialized.

    Returns:
        The communicator; ``None`` when not distributed or with one process.

    Raises:
        TypeError: For anything but ``None`` or a process group.
    """
    if process_group is None:
        if not world_initialized():
            return None
        process_group = dist.group.WORLD
    elif not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise TypeError(
            "process_group must be None (the torch.distributed world group when "
            "initialized) or a torch.distributed ProcessGroup, got "
            f"{type(process_group).__name__}."
        )
    if dist.get_world_size(process_group) == 1:
        return None
    return Communicator(process_group)
