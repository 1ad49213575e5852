"""Loss derivatives for the square-root extensions: deferred checks, own sampling.

BackPACK's loss derivatives check on the host that the gradient reaching the loss is
1 and sample the Monte-Carlo square root from the global random state. These
subclasses leave that check to the owning extension's ``deferred_checks`` (read once
per step by the optimizer) and draw from the extension's generator. The binary
cross-entropy also takes ``(N, C)`` logits (multi-label) and soft targets, which
BackPACK refuses: its Hessian with respect to the logits, ``diag(σ(1 − σ))``, depends
on neither.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from backpack.core.derivatives.bcewithlogitsloss import BCELossWithLogitsDerivatives
from backpack.core.derivatives.crossentropyloss import CrossEntropyLossDerivatives
from backpack.core.derivatives.mseloss import MSELossDerivatives
from backpack.extensions.secondorder.sqrt_ggn.losses import SqrtGGNBaseLossModule
from backpack.utils.subsampling import subsample
from torch import Generator, Tensor
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, Module, MSELoss

from dampednewton.backpack.loss_checks import DeferredChecks
from dampednewton.backpack.savefields import module_input
from dampednewton.math.sampling import (
    sampled_binary_cross_entropy_gradients,
    sampled_cross_entropy_gradients,
)


class SquareRootExtension(Protocol):
    """What the loss derivatives read of the extension that owns them."""

    deferred_checks: DeferredChecks | None

    def set_module_extension(
        self, module: type, extension: Any, overwrite: bool = False
    ) -> None:
        """BackPACK's: the extension's handler for a module type."""


class _DeferredLossCheck:
    """Loss derivatives whose check of the loss's output gradient can wait.

    BackPACK warns when the gradient reaching the loss is not 1 (``backward`` on a
    multiple of the loss), reading the gradient on the host. With the owning
    extension's ``deferred_checks`` set, the flag is left there instead and the
    optimizer warns after its one read.
    """

    owner: SquareRootExtension | None

    def _check_loss_has_not_been_modified(
        self, module: Module, g_out: tuple[Tensor] | None
    ) -> None:
        deferred = None if self.owner is None else self.owner.deferred_checks
        if deferred is None:
            super()._check_loss_has_not_been_modified(module, g_out)  # type: ignore[misc]
        elif g_out is not None:
            deferred.add_loss_weight(g_out[0])
            deferred.loss_name = str(module)


class _DeferringCrossEntropyDerivatives(
    _DeferredLossCheck, CrossEntropyLossDerivatives
):
    """Cross-entropy derivatives with the deferred check, labels from a generator.

    The exact square root ignores the generator; Monte-Carlo sampling draws its
    labels from it (``math.sampling.sampled_cross_entropy_gradients``).
    """

    def __init__(self, owner: SquareRootExtension, generator: Generator | None):
        super().__init__()
        self.owner, self.generator = owner, generator

    def compute_sampled_grads(self, subsampled_input: Tensor, mc_samples: int):
        return sampled_cross_entropy_gradients(
            subsampled_input, mc_samples, self.generator
        )


class _DeferringMSEDerivatives(_DeferredLossCheck, MSELossDerivatives):
    def __init__(self, owner: SquareRootExtension):
        super().__init__()
        self.owner = owner


class BinaryCrossEntropyDerivatives(_DeferredLossCheck, BCELossWithLogitsDerivatives):
    """Binary cross-entropy derivatives for ``(N, C)`` logits and any targets.

    Per sample the Hessian with respect to the ``C`` logits is ``diag(σ(1 − σ))``
    (the outputs' losses are summed), divided by ``N·C`` for the mean: the exact
    square root is that diagonal's square root, ``C`` columns per sample; Monte-Carlo
    draws each output's label from the model's own sigmoid with the generator
    (``math.sampling.sampled_binary_cross_entropy_gradients``). Neither reads the
    targets, so soft targets (label smoothing) are fine. For ``C = 1`` the exact
    square root is BackPACK's. Without an ``owner`` (the diagonal curvature
    extensions of the diagnostics) the loss's check runs at once, as BackPACK's.
    """

    def __init__(
        self, owner: SquareRootExtension | None, generator: Generator | None = None
    ):
        """Keep the owning extension and the Monte-Carlo generator.

        Args:
            owner: The extension whose ``deferred_checks`` take the loss's check
                (``None``: check at once).
            generator: The Monte-Carlo generator (``None``: the global state).
        """
        super().__init__()
        self.owner, self.generator = owner, generator

    def _verify_support(self, module: BCEWithLogitsLoss) -> None:
        self._check_is_default(module)
        self._check_input_dims(module)

    def _check_input_dims(self, module: BCEWithLogitsLoss) -> None:
        if module_input(module).dim() != 2:
            raise NotImplementedError(
                "Only 2D inputs (N, C) are supported: a final nn.Linear(..., 1) for "
                "one output per sample, without a squeeze."
            )

    def _sqrt_hessian(
        self,
        module: BCEWithLogitsLoss,
        g_inp: tuple[Tensor],
        g_out: tuple[Tensor],
        subsampling: list[int] | None = None,
    ) -> Tensor:
        self._verify_support(module)
        logits = module_input(module)
        probs = subsample(logits, subsampling=subsampling).detach().sigmoid()
        roots = (probs * (1 - probs)).sqrt() / math.sqrt(logits.numel())
        return roots.diag_embed().permute(1, 0, 2).contiguous()  # [C, N, C]

    def compute_sampled_grads(self, subsampled_input: Tensor, mc_samples: int):
        """Gradients at labels drawn from the model's sigmoid, ``[M, N, C]``."""
        return sampled_binary_cross_entropy_gradients(
            subsampled_input, mc_samples, self.generator
        )

    @staticmethod
    def _get_mean_normalization(input: Tensor) -> int:
        return input.numel()


#: Losses whose Monte-Carlo square root draws from the generator directly.
SAMPLED_WITH_GENERATOR = (CrossEntropyLoss, BCEWithLogitsLoss)


def set_loss_extensions(
    extension: SquareRootExtension, generator: Generator | None = None
) -> None:
    """Give a square-root extension these loss derivatives.

    Args:
        extension: BackPACK's ``SqrtGGNExact`` or ``SqrtGGNMC`` (or a subclass).
        generator: The Monte-Carlo generator (``None``: the global random state).
    """
    for loss, derivatives in (
        (CrossEntropyLoss, _DeferringCrossEntropyDerivatives(extension, generator)),
        (MSELoss, _DeferringMSEDerivatives(extension)),
        (BCEWithLogitsLoss, BinaryCrossEntropyDerivatives(extension, generator)),
    ):
        extension.set_module_extension(
            loss, SqrtGGNBaseLossModule(derivatives), overwrite=True
        )
