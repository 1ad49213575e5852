"""The optimizer's own random generator for Monte-Carlo sampling, and its state.

Monte-Carlo square roots of the loss Hessian draw from a generator seeded once per
optimizer, so that a run is reproducible and a checkpoint resumes the same draws.
The generator lives on the device of the first parameter and is created the first
time it is needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Generator


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

    def state_dict(self, device: torch.device) -> dict[str, Any]:
        """The seed and the generator's state, for the optimizer's state dict.

        Args:
            device: The device of the optimizer's parameters.

        Returns:
            ``{'seed': ..., 'generator': ...}``.
        """
        return {"seed": self.seed, "generator": self.get(device).get_state()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Resume from :meth:`state_dict`'s output.

        Args:
            state: The saved seed and generator state (``None``: fresh from the
                seed).
            device: The device of the optimizer's parameters.
        """
        self.seed = state["seed"]
        self._generator = None
        if state["generator"] is not None:
            self.get(device).set_state(state["generator"])
