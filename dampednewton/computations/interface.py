"""ViViT's interface of a computation over its :class:`GGNEngine`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic

from backpack.extensions.backprop_extension import BackpropExtension

from dampednewton.backpack.passes import Hook
from dampednewton.computations.engine import GGNEngine, ResultT


class GGNComputation(Generic[ResultT]):
    """ViViT's interface of a computation: extensions, hook, result per group.

    Subclasses create :attr:`_engine` with their ``_finish`` and type the result.
    """

    _engine: GGNEngine[ResultT]

    def get_extensions(self) -> list[BackpropExtension]:
        """Instantiate the BackPACK extensions this computation needs.

        Returns:
            Extensions to pass to the ``with backpack(...)`` context.
        """
        return self._engine.extensions()

    def get_extension(self) -> BackpropExtension:
        """Instantiate the single BackPACK extension of gradient-free computations.

        Returns:
            The square-root extension to pass to the ``with backpack(...)`` context.
        """
        return self._engine.extensions()[0]

    def get_extension_hook(self, param_groups: Sequence[dict]) -> Hook:
        """Instantiate the hook that reduces BackPACK's buffers during backward.

        Args:
            param_groups: Groups as for a ``torch.optim.Optimizer``; each group is one
                GGN block. See the class for the keys it needs.

        Returns:
            The hook to pass as ``extension_hook`` to ``backpack(...)``. It computes
            every group's result during the backward pass (fresh ones on every pass).
        """
        return self._engine.hook(param_groups)

    def _result(self, group: dict) -> ResultT:
        return self._engine.result(group)
