"""The Monte-Carlo traces' draws, from the monitor's own generator.

BackPACK's ``DiagGGNMC`` samples the loss Hessian's square root from torch's global
random state, so a monitored step would change the user's random stream (dropout
masks, data shuffling) and a run would train differently with a diagnostic than
without it. :class:`SeededDiagGGNMC` samples at the loss module inside
:func:`~dampednewton.backpack.seeding.drawing_from` the monitor's generator
(:class:`MonteCarloDraws`): the global stream is untouched and the traces are
reproducible from the monitor's seed. Under ``torch.distributed`` each rank draws
from the generator reseeded for its rank and the step, as the optimizer's sampling
does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
from backpack.extensions import DiagGGNMC
from backpack.extensions.backprop_extension import BackpropExtension
from torch import Generator, Tensor
from torch.nn import Module
from torch.nn.modules.loss import _Loss

from dampednewton.backpack.loss_checks import DeferredChecks
from dampednewton.backpack.savefields import module_input
from dampednewton.backpack.seeding import SeededGenerator, drawing_from
from dampednewton.distributed import Communicator

MONITOR_STREAM = 0x6D6F6E
"""Mixed into ``torch.initial_seed()``: the monitor's draws are not the optimizer's."""


class MonteCarloDraws:
    """The generator of a monitor's Monte-Carlo traces.

    Attributes:
        seeded: The seed and the generator (created at the first draw, on the
            device of the model's output).
        communicator: The ranks' collectives (``None``: one process).
        step: The step whose backward pass draws next.
    """

    def __init__(self, seed: int | None, communicator: Communicator | None) -> None:
        """Seed the generator (``None``: from torch's initial seed, rank 0's).

        Args:
            seed: The seed, or ``None`` for one derived from ``torch.initial_seed()``
                (what ``torch.manual_seed`` set), which leaves torch's global random
                stream where it was: creating the monitor changes no draw of the run.
            communicator: The ranks' collectives (``None``: one process).
        """
        entropy = np.random.SeedSequence([torch.initial_seed(), MONITOR_STREAM])
        derived = int(entropy.generate_state(1, np.uint64)[0] >> 1)
        self.seeded = SeededGenerator(derived if seed is None else seed)
        if communicator is not None and seed is None:
            self.seeded.seed = communicator.broadcast_seed(self.seeded.seed)
        self.communicator = communicator
        self.step = 0

    def generator(self, device: torch.device) -> Generator:
        """The generator of this step's draws on ``device``."""
        if self.communicator is None:
            return self.seeded.get(device)
        return self.seeded.for_rank(device, self.communicator.rank, self.step)


class SeededDiagGGNMC(DiagGGNMC):
    """BackPACK's ``DiagGGNMC`` drawing from a :class:`MonteCarloDraws` generator.

    Attributes:
        draws: The source of the draws (``None``: torch's global random state).
    """

    def __init__(self, mc_samples: int) -> None:
        """Sample ``mc_samples`` times; the monitor sets :attr:`draws`."""
        super().__init__(mc_samples=mc_samples)
        self.draws: MonteCarloDraws | None = None
        self.deferred_checks: DeferredChecks | None = None
        """Set by ``DampedNewton`` for its pass: a non-finite model output is then
        sampled as zeros and flagged there (the step is refused), as its own
        Monte-Carlo curvature does, instead of raising inside ``backward``."""

    def __call__(
        self, module: Module, g_inp: tuple[Tensor], g_out: tuple[Tensor]
    ) -> None:
        """Run BackPACK's extension, sampling at the loss from the generator."""
        if not isinstance(module, _Loss):
            super().__call__(module, g_inp, g_out)
            return
        output = module_input(module)
        if self.deferred_checks is not None:
            self.deferred_checks.sampled_safely(output)
        if self.draws is None:
            super().__call__(module, g_inp, g_out)
            return
        with drawing_from(self.draws.generator(output.device)):
            super().__call__(module, g_inp, g_out)


def monte_carlo_draws(
    extensions: Iterable[Sequence[BackpropExtension]],
    seed: int | None,
    communicator: Communicator | None,
) -> MonteCarloDraws | None:
    """Give the monitor's Monte-Carlo extensions one generator; ``None`` if none.

    Args:
        extensions: The diagnostics' extensions.
        seed: The monitor's seed (``None``: drawn, and only with a Monte-Carlo
            trace).
        communicator: The ranks' collectives (``None``: one process).

    Returns:
        The draws every :class:`SeededDiagGGNMC` shares.

    Raises:
        ValueError: If two traces ask for different numbers of samples (BackPACK
            runs one ``DiagGGNMC`` per backward pass).
    """
    sampled = [
        extension
        for each in extensions
        for extension in each
        if isinstance(extension, SeededDiagGGNMC)
    ]
    if not sampled:
        return None
    counts = {extension.get_num_mc_samples() for extension in sampled}
    if len(counts) > 1:
        raise ValueError(
            "BackPACK runs one DiagGGNMC per backward pass, but the traces ask "
            f"for mc_samples {sorted(counts)}; use one value."
        )
    draws = MonteCarloDraws(seed, communicator)
    for extension in sampled:
        extension.draws = draws
    return draws
