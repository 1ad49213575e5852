"""What a monitor collects during a step's backward pass, and what it finished."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from dampednewton.diagnostics.reducer import Reducer

REPEATED_PARAMETER = (
    "A parameter's BackPACK quantities reached the monitor twice in the backward pass "
    "of step {step}: the context ran several backward passes (gradient accumulation "
    "over micro-batches) or a parameter belongs to two modules (weight tying). Each "
    "diagnostic describes one mini-batch, so the record would mix the last "
    "micro-batch's per-sample quantities with the accumulated .grad. Run one forward "
    "and one backward pass of the whole batch inside the context, with every "
    "parameter in one module."
)


@dataclass
class PendingStep:
    """Pieces collected by the hook of one step.

    Attributes:
        step: The step.
        reducers: The diagnostics scheduled at it.
        batch_sizes: The batch sizes the layers saw.
        seen: The parameters reached (by ``id``).
        repeated: Whether a parameter was reached twice.
        reached: Per module, its parameters in the order backward reached them
            (the model's order reversed).
    """

    step: int
    reducers: list[Reducer]
    batch_sizes: set[int] = field(default_factory=set)
    seen: set[int] = field(default_factory=set)
    repeated: bool = False
    reached: list[list[Tensor]] = field(default_factory=list)

    def reach(self, param: Tensor, batch_size: int) -> None:
        """Record that backward reached ``param`` with ``batch_size`` samples."""
        self.batch_sizes.add(batch_size)
        self.repeated = self.repeated or id(param) in self.seen
        self.seen.add(id(param))

    def reached_parameters(self) -> list[Tensor]:
        """The parameters with BackPACK quantities, modules in the model's order."""
        return [param for params in reversed(self.reached) for param in params]


@dataclass
class FinishedStep:
    """A step finished when its backward context exited, and its log position."""

    pending: PendingStep
    index: int
