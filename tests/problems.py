"""Tiny, deterministic test problems (model, loss, data) for float64 comparisons.

Every problem is small enough (N = 4..6 samples, C ≤ 3 outputs, D ≤ 405
parameters) that the full D×D GGN and its eigendecomposition are instant.
Parameters and data are drawn from a local ``torch.Generator`` seeded with the
problem's seed; the global RNG is never touched (modules are created on the meta
device, so torch's default initialization does not run).

All modules are supported by BackPACK's ``SqrtGGNExact`` and ``BatchGrad``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

NUM_CLASSES = 3


@dataclass(frozen=True)
class Problem:
    """A model, a loss and a mini-batch, reproducible from a seed.

    Attributes:
        id: Readable identifier, used as pytest id.
        model: Factory that builds the model and draws its parameters from the
            generator it receives.
        loss: Factory for the loss module (``reduction="mean"``).
        data: Factory that draws inputs ``X`` and targets ``y`` from the generator.
        seed: Seed of the generator passed to ``model`` and then to ``data``.
    """

    id: str
    model: Callable[[torch.Generator], nn.Module]
    loss: Callable[[], nn.Module]
    data: Callable[[torch.Generator], tuple[Tensor, Tensor]]
    seed: int

    def build(
        self, dtype: torch.dtype = torch.float64
    ) -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
        """Create a fresh model, loss function and mini-batch.

        The same seed gives the same values on every call; values are drawn in
        float64 and then cast to ``dtype``. Integer targets stay integer.

        Args:
            dtype: Floating-point type of the parameters, inputs and float targets.

        Returns:
            ``(model, loss_fn, X, y)``.

        Raises:
            ValueError: If ``dtype`` is not a floating-point type.
        """
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point type, got {dtype}.")
        generator = torch.Generator().manual_seed(self.seed)
        model = self.model(generator).to(dtype)
        X, y = self.data(generator)
        X = X.to(dtype)
        if y.is_floating_point():
            y = y.to(dtype)
        return model, self.loss(), X, y


def initialize(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """Materialize a meta-device module in float64 with parameters from a generator.

    Each layer's weight and bias are drawn from N(0, 1/fan_in), fan_in being the
    number of weight entries per output unit.

    Args:
        module: Module whose parameters live on the meta device.
        generator: Source of the parameter values.

    Returns:
        The module, on the CPU in float64, with initialized parameters.
    """
    module = module.to_empty(device="cpu").to(torch.float64)
    with torch.no_grad():
        for layer in module.modules():
            weight = getattr(layer, "weight", None)
            if not isinstance(weight, nn.Parameter):
                continue
            scale = weight[0].numel() ** -0.5
            for param in (weight, getattr(layer, "bias", None)):
                if isinstance(param, nn.Parameter):
                    param.copy_(
                        scale
                        * torch.randn(
                            param.shape, generator=generator, dtype=torch.float64
                        )
                    )
    return module


def _mlp_relu(generator: torch.Generator) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, NUM_CLASSES))
    return initialize(model, generator)


def _mlp_sigmoid(generator: torch.Generator) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, NUM_CLASSES))
    return initialize(model, generator)


def _mlp_tanh_scalar(generator: torch.Generator) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))
    return initialize(model, generator)


def _cnn(generator: torch.Generator) -> nn.Module:
    # [N, 1, 6, 6] -> conv [N, 2, 4, 4] -> pool [N, 2, 2, 2] -> flatten [N, 8]
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(1, 2, kernel_size=3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(8, NUM_CLASSES),
        )
    return initialize(model, generator)


def _sequence_mlp(generator: torch.Generator) -> nn.Module:
    # [N, 2, 12] -> shared Linear [N, 2, 6] -> flatten [N, 12]: few positions, so the
    # first weight takes the structured shared-weight path.
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Linear(12, 6), nn.Tanh(), nn.Flatten(), nn.Linear(12, NUM_CLASSES)
        )
    return initialize(model, generator)


def _cnn_few_positions(generator: torch.Generator) -> nn.Module:
    # [N, 6, 4, 4] -> conv [N, 6, 2, 2] -> flatten [N, 24]: 4 output positions and 54
    # inputs per position, so the exact GGN's conv weight is contracted structurally.
    with torch.device("meta"):
        model = nn.Sequential(
            nn.Conv2d(6, 6, kernel_size=3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(24, NUM_CLASSES),
        )
    return initialize(model, generator)


def _linear_2_to_3(generator: torch.Generator) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, NUM_CLASSES))
    return initialize(model, generator)


def _linear_5_to_3(generator: torch.Generator) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, NUM_CLASSES))
    return initialize(model, generator)


def _cross_entropy() -> nn.Module:
    return nn.CrossEntropyLoss(reduction="mean")


def _mse() -> nn.Module:
    return nn.MSELoss(reduction="mean")


def _bce_with_logits() -> nn.Module:
    return nn.BCEWithLogitsLoss(reduction="mean")


def _features(generator: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def _labels(generator: torch.Generator, num_samples: int) -> Tensor:
    return torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator)


def _classification_4x5(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return _features(generator, 4, 5), _labels(generator, 4)


def _regression_5x5(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return _features(generator, 5, 5), _features(generator, 5, NUM_CLASSES)


def _binary_6x5(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    targets = torch.randint(0, 2, (6, 1), generator=generator).to(torch.float64)
    return _features(generator, 6, 5), targets


def _images_4x1x6x6(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return _features(generator, 4, 1, 6, 6), _labels(generator, 4)


def _sequences_4x2x12(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return _features(generator, 4, 2, 12), _labels(generator, 4)


def _images_4x6x4x4(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return _features(generator, 4, 6, 4, 4), _labels(generator, 4)


def _classification_6x2(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return _features(generator, 6, 2), _labels(generator, 6)


def _regression_4x5(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return _features(generator, 4, 5), _features(generator, 4, NUM_CLASSES)


PROBLEMS: list[Problem] = [
    # N=4, C=3, D=39: ReLU MLP, cross-entropy (GGN rank ≤ N·(C-1) = 8).
    Problem("mlp-ce", _mlp_relu, _cross_entropy, _classification_4x5, seed=0),
    # N=5, C=3, D=39: sigmoid MLP, mean squared error.
    Problem("mlp-mse", _mlp_sigmoid, _mse, _regression_5x5, seed=1),
    # N=6, C=1, D=29: BackPACK's BCEWithLogitsLoss only supports [N, 1] logits.
    Problem("mlp-bce", _mlp_tanh_scalar, _bce_with_logits, _binary_6x5, seed=2),
    # N=4, C=3, D=47: Conv2d-ReLU-MaxPool2d-Flatten-Linear, cross-entropy.
    Problem("cnn-ce", _cnn, _cross_entropy, _images_4x1x6x6, seed=3),
    # N=6, C=3, D=9 < N·C = 18: the Gram matrix is larger than the GGN.
    # Linear in θ, so GGN = Hessian.
    Problem("mlp-ce-wide", _linear_2_to_3, _cross_entropy, _classification_6x2, seed=4),
    # N=4, C=3, D=117: nn.Linear shared over 2 positions, cross-entropy.
    Problem("seq-ce", _sequence_mlp, _cross_entropy, _sequences_4x2x12, seed=6),
    # N=4, C=3, D=405: convolution with 4 output positions, cross-entropy.
    Problem("cnn-wide-ce", _cnn_few_positions, _cross_entropy, _images_4x6x4x4, seed=7),
]
"""Problems whose non-zero GGN eigenvalues are simple, so eigenvectors are unique
up to sign. Cross-entropy GGNs also have zero eigenvalues (rank ≤ N·(C−1))."""

LINEAR_MSE = Problem("linear-mse", _linear_5_to_3, _mse, _regression_4x5, seed=5)
"""Linear regression, N=4, C=3, D=18 > N·C = 12, GGN rank 12; linear in θ, so the
GGN is the Hessian. Not in ``PROBLEMS``: its GGN is ``(2/(NC)) X̃ᵀX̃ ⊗ I_C``, so every
eigenvalue is C-fold and eigenvectors are only defined up to rotation. Use it for
quantities that are invariant to that, such as the step along all non-zero
directions."""


def problem_ids() -> list[str]:
    """Return the ids of ``PROBLEMS``, in order (for ``pytest`` parametrization).

    Returns:
        The problem ids.
    """
    return [problem.id for problem in PROBLEMS]


def readme_problem() -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
    """README's optimizer example: extended model and loss, inputs needing no grad."""
    from backpack import extend

    gen = torch.Generator().manual_seed(0)
    X = torch.randn(128, 10, generator=gen)
    y = (X[:, :3].sum(1) > 0).long() + (X[:, 3] > 1).long()
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)))
    return model, extend(nn.CrossEntropyLoss()), X, y
