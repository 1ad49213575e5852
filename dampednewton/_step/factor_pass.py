"""How a Kronecker refresh collects its layers' factors: BackPACK's pass or autograd's.

The first refresh, and every refresh with the exact GGN, a monitor, or a model the
autograd pass does not cover, runs the closure inside a BackPACK pass
(:class:`~dampednewton.backpack.kronecker_hook.FactorCollector`). Later Monte-Carlo
refreshes back-propagate the sampled square root with one ``torch.autograd.grad``
instead (:mod:`~dampednewton.backpack.autograd_factors`), with BackPACK's hooks
suspended as between refreshes. Where that pass meets something it does not cover (on
any rank, under data parallelism: the ranks agree on it with their mean loss), the
step keeps the stored bases and every later refresh runs through BackPACK.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

from torch import Generator, Tensor

from dampednewton._step.options import SharedOptions
from dampednewton.backpack.autograd_factors import AutogradFactors
from dampednewton.backpack.extensions import ExactSqrtGGN, MonteCarloSqrtGGN
from dampednewton.backpack.kronecker_hook import FactorCollector, LayerFactors
from dampednewton.backpack.layers import use_structured_sqrt_ggn
from dampednewton.backpack.loss_checks import DeferredChecks
from dampednewton.backpack.savefields import sqrt_ggn_savefield


@dataclass
class FactorPass:
    """A refresh's way to its factors.

    Attributes:
        extensions: The BackPACK extensions of the closure's pass (none: a pass
            without BackPACK's hooks).
        hooks: Their extension hooks.
        collector: The BackPACK pass's factors (``None``: autograd's).
        autograd: The autograd pass's factors (``None``: BackPACK's).
    """

    extensions: list = field(default_factory=list)
    hooks: list = field(default_factory=list)
    collector: FactorCollector | None = None
    autograd: AutogradFactors | None = None

    def collecting(self) -> AbstractContextManager:
        """The context to run the closure in (the autograd pass's forward hooks)."""
        return nullcontext() if self.autograd is None else self.autograd.collecting()

    def layers(self) -> dict[int, LayerFactors] | None:
        """The layers' factors after the closure (``None``: the pass fell short).

        Raises:
            RuntimeError: From the BackPACK pass, for micro-batches that reached
                different layers.
        """
        if self.collector is not None:
            self.collector.check_every_pass_reached_every_layer()
            return self.collector.layers
        assert self.autograd is not None
        return self.autograd.layers()


class FactorPasses:
    """Picks each refresh's pass; keeps BackPACK's extension while its settings hold.

    Attributes:
        autograd: Whether a refresh may still take the autograd pass (off for good
            once it fell short).
    """

    def __init__(self) -> None:
        """Start with no extension; the autograd pass allowed."""
        self.autograd = True
        self._cached: tuple[tuple, ExactSqrtGGN | MonteCarloSqrtGGN] | None = None

    def start(
        self,
        shared: SharedOptions,
        generator: Generator | None,
        collected: Sequence[Tensor],
        deferred: DeferredChecks,
        *,
        bases_stored: bool,
        monitored: bool,
    ) -> FactorPass:
        """The pass of a refresh of the ``collected`` parameters.

        Args:
            shared: The backward pass's options.
            generator: The Monte-Carlo draws' source.
            collected: The parameters whose factors the refresh needs.
            deferred: The step's deferred checks.
            bases_stored: Whether every refreshing group has stored bases to keep
                if the autograd pass falls short.
            monitored: Whether a monitor's extensions run in the pass (BackPACK's).

        Returns:
            The autograd pass where it applies, else BackPACK's.
        """
        if self.autograd and shared.mc_samples > 0 and bases_stored and not monitored:
            autograd = AutogradFactors(
                collected,
                shared.mc_samples,
                shared.subsampling_ggn,
                generator,
                deferred,
            )
            return FactorPass(autograd=autograd)
        sqrt_ggn = self._extension(shared, generator)
        sqrt_ggn.deferred_checks = deferred
        collector = FactorCollector(
            sqrt_ggn_savefield(shared.mc_samples),
            collected,
            sqrt_ggn,
            subsampled=shared.subsampling_ggn is not None,
        )
        return FactorPass([sqrt_ggn], [collector.hook], collector=collector)

    def _extension(
        self, shared: SharedOptions, generator: Generator | None
    ) -> ExactSqrtGGN | MonteCarloSqrtGGN:
        """The structured square-root extension, kept while its settings hold."""
        key = (shared.mc_samples, tuple(shared.subsampling_ggn or ()), id(generator))
        if self._cached is None or self._cached[0] != key:
            extension = (
                MonteCarloSqrtGGN(shared.mc_samples, shared.subsampling_ggn, generator)
                if shared.mc_samples > 0
                else ExactSqrtGGN(subsampling=shared.subsampling_ggn)
            )
            use_structured_sqrt_ggn(extension)
            self._cached = (key, extension)
        return self._cached[1]
