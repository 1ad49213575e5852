"""A private random generator for Monte-Carlo sampling, and its state.

Monte-Carlo square roots of the loss Hessian (the optimizer's curvature, the
diagnostics' Monte-Carlo traces) draw from a generator seeded once per owner, so that
a run is reproducible, a checkpoint resumes the same draws and the user's global
random stream (dropout masks, data shuffling) is untouched. The generator lives on
the device of the sampled quantities and is created the first time it is needed.
:func:`drawing_from` lends it to code that samples from the global random state
(BackPACK's loss derivatives).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Generator, Tensor
from torch.random import fork_rng


@contextmanager
def drawing_from(generator: Generator) -> Iterator[None]:
    """Let the code inside draw from ``generator`` through torch's global random state.

    The global state of ``generator``'s device is forked, set to the generator's,
    and after the block the generator takes the advanced state; the global state is
    as it was before (also after an error).

    Args:
        generator: The source of the draws (CPU or CUDA).

    Yields:
        Nothing; sample inside.
    """
    device = generator.device
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        with fork_rng(devices=[index]):
            torch.cuda.set_rng_state(generator.get_state(), index)
            yield
            generator.set_state(torch.cuda.get_rng_state(index))
    else:
        with fork_rng(devices=[]):
            torch.set_rng_state(generator.get_state())
            yield
            generator.set_state(torch.get_rng_state())


def _restore(generator: Generator, state: Tensor, seed: int) -> None:
    """Set a saved state; one of another device's generator reseeds, with a warning.

    A CUDA generator's state does not fit a CPU generator (and back): a checkpoint of
    a GPU run resumed on the CPU still loads, its draws going on from ``seed``.
    """
    try:
        generator.set_state(state)
    except RuntimeError:
        warnings.warn(
            f"The saved Monte-Carlo generator state ({state.numel()} bytes) belongs "
            f"to a generator of another device than {generator.device} (a checkpoint "
            "of a run on another device): the draws go on from the seed, so they "
            "differ from those the saved run would have taken.",
            RuntimeWarning,
            stacklevel=4,
        )
        entropy = np.random.SeedSequence([seed, state.numel()])
        generator.manual_seed(int(entropy.generate_state(1, np.uint64)[0]))


class SeededGenerator:
    """A generator created lazily from a seed; saved and loaded with the optimizer.

    Attributes:
        seed: The seed (``None`` at construction draws one from torch's global
            generator).
    """

    def __init__(self, seed: int | None):
        """Remember the seed.

        Args:
            seed: Seed of the generator, or ``None`` to draw one.

        Raises:
            TypeError: For a seed that is not an integer.
        """
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int | np.integer)
        ):
            raise TypeError(f"seed must be an integer or None, got {seed!r}.")
        self.seed = (
            int(torch.randint(2**62, (1,)).item()) if seed is None else int(seed)
        )
        self._generator: Generator | None = None
        self._loaded: Tensor | None = None  # a loaded state, set on creation

    def get(self, device: torch.device) -> Generator:
        """The generator, created on ``device`` the first time.

        Args:
            device: The device of the optimizer's parameters.

        Returns:
            The generator.

        Raises:
            RuntimeError: For the meta device.
        """
        if self._generator is None:
            if device.type == "meta":
                raise RuntimeError(
                    "The parameters are on the meta device, which holds no values: "
                    "materialize the model (e.g. model.to_empty(device='cpu') and "
                    "initialize it) before creating the optimizer."
                )
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
            if self._loaded is not None:
                _restore(self._generator, self._loaded, self.seed)
                self._loaded = None
        return self._generator

    @property
    def created(self) -> Generator | None:
        """The generator, if a step created it already (``None``: not yet)."""
        return self._generator

    def for_rank(self, device: torch.device, rank: int, step: int) -> Generator:
        """The generator, reseeded for one rank's draws of one step.

        Under data parallelism each rank draws different Monte-Carlo labels,
        determined by the seed, the rank and the step, so that a checkpoint (which
        holds the seed and the step) resumes the same draws on every rank.

        Args:
            device: The device of the optimizer's parameters.
            rank: This process's rank.
            step: The step's index.

        Returns:
            The reseeded generator.
        """
        entropy = np.random.SeedSequence([self.seed, rank, step])
        return self.get(device).manual_seed(
            int(entropy.generate_state(1, np.uint64)[0])
        )

    def state_dict(self, device: torch.device | None = None) -> dict[str, Any]:
        """The seed and the generator's state, for the owner's state dict.

        Args:
            device: Where to create the generator if no draw created it yet
                (``None``: leave it uncreated; its state is then the loaded one, or
                ``None`` for a fresh start from the seed).

        Returns:
            ``{'seed': ..., 'generator': ...}``.
        """
        if device is not None:
            self.get(device)
        generator = self._loaded if self._generator is None else self._generator
        state = generator.get_state() if isinstance(generator, Generator) else generator
        return {"seed": self.seed, "generator": state}

    def load_state_dict(
        self, state: dict[str, Any], device: torch.device | None = None
    ) -> None:
        """Resume from :meth:`state_dict`'s output.

        Args:
            state: The saved seed and generator state (``None``: fresh from the
                seed).
            device: Where to create the generator now (``None``: at the next draw,
                on the device it asks for).
        """
        self.seed = state["seed"]
        self._generator = None
        self._loaded = state["generator"]
        if device is not None:
            self.get(device)
