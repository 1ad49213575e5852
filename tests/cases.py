"""The test problems: one declarative list of tiny, deterministic float64 problems.

Every problem is a model, a loss, a mini-batch and a seed, small enough (N ≤ 8
samples, C ≤ 3 outputs, D ≤ 405 parameters) that the full D×D GGN and its
eigendecomposition are instant. Parameters and data are drawn from a local
``torch.Generator`` seeded with the problem's seed; the global RNG is never touched
(modules are created on the meta device, so torch's default initialization does not
run). All modules are supported by BackPACK's ``SqrtGGNExact`` and ``BatchGrad``, or
by the modules the package adds to them (``dampednewton/backpack/activations.py``,
``adaptive_pooling.py``).

Each problem is tagged with the suites that use it; ``PROBLEMS``,
``DIAGNOSTICS_PROBLEMS`` and ``KRONECKER_PROBLEMS`` are the tagged selections of
``CASES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from backpack import extend
from torch import Tensor, nn

from tests import case_models as models
from tests.case_models import NUM_CLASSES

SIMPLE_SPECTRUM = "simple-spectrum"
"""Tag: the non-zero GGN eigenvalues are simple, so eigenvectors are unique up to
sign (cross-entropy GGNs also have zero eigenvalues, rank ≤ N·(C−1)). The optimizer,
computation and reference tests run on these."""
KRONECKER = "kronecker"
"""Tag: every parameter belongs to an ``nn.Linear`` or ``nn.Conv1d/2d`` layer, so the
Kronecker basis covers the model; its optimizer tests run on these."""
DIAGNOSTICS = "diagnostics"
"""Tag: a batch of N ≥ 6 (the debiased GSNR needs N ≥ 4); the diagnostics tests run
on these."""


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
        tags: The suites that use the problem (``SIMPLE_SPECTRUM``, ``DIAGNOSTICS``).
    """

    id: str
    model: Callable[[torch.Generator], nn.Module]
    loss: Callable[[], nn.Module]
    data: Callable[[torch.Generator], tuple[Tensor, Tensor]]
    seed: int
    tags: frozenset[str] = frozenset()

    def build(
        self, dtype: torch.dtype = torch.float64, device: str = "cpu"
    ) -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
        """Create a fresh model, loss function and mini-batch.

        The same seed gives the same values on every call and device; values are
        drawn in float64 on the CPU and then cast to ``dtype`` and moved to
        ``device``. Integer targets stay integer.

        Args:
            dtype: Floating-point type of the parameters, inputs and float targets.
            device: Device of the parameters, inputs and targets.

        Returns:
            ``(model, loss_fn, X, y)``.

        Raises:
            ValueError: If ``dtype`` is not a floating-point type.
        """
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point type, got {dtype}.")
        generator = torch.Generator().manual_seed(self.seed)
        model = self.model(generator).to(device=device, dtype=dtype)
        X, y = self.data(generator)
        X = X.to(device=device, dtype=dtype)
        y = y.to(device=device, dtype=dtype if y.is_floating_point() else y.dtype)
        return model, self.loss(), X, y


@dataclass(frozen=True)
class Classification:
    """Data factory: inputs ``~ N(0, 1)`` of ``shape``, class labels ``< C``."""

    shape: tuple[int, ...]

    def __call__(self, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Draw ``(X, y)`` from the generator."""
        X = torch.randn(self.shape, generator=generator, dtype=torch.float64)
        y = torch.randint(0, NUM_CLASSES, self.shape[:1], generator=generator)
        return X, y


@dataclass(frozen=True)
class Regression:
    """Data factory: inputs ``~ N(0, 1)`` of ``shape``, ``[N, C]`` targets too."""

    shape: tuple[int, ...]

    def __call__(self, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Draw ``(X, y)`` from the generator."""
        X = torch.randn(self.shape, generator=generator, dtype=torch.float64)
        y = torch.randn(
            self.shape[0], NUM_CLASSES, generator=generator, dtype=torch.float64
        )
        return X, y


def _binary_6x5(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    targets = torch.randint(0, 2, (6, 1), generator=generator).to(torch.float64)
    return torch.randn(6, 5, generator=generator, dtype=torch.float64), targets


def _soft_multilabel_4x5(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    targets = torch.rand(4, NUM_CLASSES, generator=generator, dtype=torch.float64)
    # Inputs of scale 2: the GGN's eigenvalues (σ(1 − σ)/C ≤ 1/12 per output) stay
    # above the warning threshold.
    inputs = 2 * torch.randn(4, 5, generator=generator, dtype=torch.float64)
    return inputs, targets


def _soft_multilabel_8x5(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    targets = torch.rand(8, NUM_CLASSES, generator=generator, dtype=torch.float64)
    return torch.randn(8, 5, generator=generator, dtype=torch.float64), targets


def _cross_entropy() -> nn.Module:
    return nn.CrossEntropyLoss(reduction="mean")


def _mse() -> nn.Module:
    return nn.MSELoss(reduction="mean")


def _bce_with_logits() -> nn.Module:
    return nn.BCEWithLogitsLoss(reduction="mean")


_STEP = frozenset({SIMPLE_SPECTRUM, KRONECKER})
_DIAGNOSTICS = frozenset({DIAGNOSTICS})

CASES: list[Problem] = [
    # N=4, C=3, D=39: ReLU MLP, cross-entropy (GGN rank ≤ N·(C-1) = 8).
    Problem(
        "mlp-ce",
        models.mlp_relu,
        _cross_entropy,
        Classification((4, 5)),
        seed=0,
        tags=_STEP,
    ),
    # N=5, C=3, D=39: sigmoid MLP, mean squared error.
    Problem(
        "mlp-mse",
        models.mlp_sigmoid,
        _mse,
        Regression((5, 5)),
        seed=1,
        tags=_STEP,
    ),
    # N=6, C=1, D=29: binary cross-entropy with one logit per sample.
    Problem(
        "mlp-bce",
        models.mlp_tanh_scalar,
        _bce_with_logits,
        _binary_6x5,
        seed=2,
        tags=_STEP,
    ),
    # N=4, C=3, D=47: [N, 1, 6, 6] -> conv [N, 2, 4, 4] -> pool [N, 2, 2, 2] ->
    # flatten [N, 8] -> Linear, cross-entropy.
    Problem(
        "cnn-ce",
        models.cnn,
        _cross_entropy,
        Classification((4, 1, 6, 6)),
        seed=3,
        tags=_STEP,
    ),
    # N=6, C=3, D=9 < N·C = 18: the Gram matrix is larger than the GGN.
    # Linear in θ, so GGN = Hessian.
    Problem(
        "mlp-ce-wide",
        models.linear_2_to_3,
        _cross_entropy,
        Classification((6, 2)),
        seed=4,
        tags=_STEP,
    ),
    # N=4, C=3, D=117: [N, 2, 12] -> shared Linear [N, 2, 6] -> flatten [N, 12]: few
    # positions, so the first weight takes the structured shared-weight path.
    Problem(
        "seq-ce",
        models.sequence_mlp,
        _cross_entropy,
        Classification((4, 2, 12)),
        seed=6,
        tags=_STEP,
    ),
    # N=4, C=3, D=405: [N, 6, 4, 4] -> conv [N, 6, 2, 2] -> flatten [N, 24]: 4 output
    # positions and 54 inputs per position, so the exact GGN's conv weight is
    # contracted structurally.
    Problem(
        "cnn-wide-ce",
        models.cnn_few_positions,
        _cross_entropy,
        Classification((4, 6, 4, 4)),
        seed=7,
        tags=_STEP,
    ),
    # N=4, C=3, D=39: ReLU MLP, multi-label binary cross-entropy with soft targets
    # in [0, 1), beyond BackPACK's own derivatives ([N, 1] logits, targets 0 or 1).
    Problem(
        "mlp-bce-multilabel",
        models.mlp_relu,
        _bce_with_logits,
        _soft_multilabel_4x5,
        seed=15,
        tags=_STEP,
    ),
    # Linear regression, N=4, C=3, D=18 > N·C = 12, GGN rank 12; linear in θ, so the
    # GGN is the Hessian. Untagged: its GGN is (2/(NC)) X̃ᵀX̃ ⊗ I_C, so every
    # eigenvalue is C-fold and eigenvectors are only defined up to rotation. Use it
    # for quantities that are invariant to that, such as the step along all non-zero
    # directions.
    Problem(
        "linear-mse",
        models.linear_5_to_3,
        _mse,
        Regression((4, 5)),
        seed=5,
        tags=frozenset({KRONECKER}),
    ),
    # N=5, C=3, D=60: [N, 2, 9] -> strided, padded Conv1d (the MNIST-1D CNN's kind).
    Problem(
        "cnn1d-ce",
        models.cnn1d,
        _cross_entropy,
        Classification((5, 2, 9)),
        seed=8,
        tags=frozenset({KRONECKER}),
    ),
    # N=5, C=3, D=75: tanh MLP 5-4-4-4-3 whose hidden layers share a shape.
    Problem(
        "deep-mlp-ce",
        models.mlp_repeated,
        _cross_entropy,
        Classification((5, 5)),
        seed=9,
        tags=frozenset({KRONECKER}),
    ),
    # N=5, C=3, D=79: GELU, SiLU and Mish, which BackPACK lacks (the package's
    # derivatives, dampednewton/backpack/activations.py).
    Problem(
        "mlp-smooth-ce",
        models.mlp_smooth,
        _cross_entropy,
        Classification((5, 5)),
        seed=17,
        tags=_STEP,
    ),
    # N=4, C=3, D=42: a CNN with a global average pooling head (AdaptiveAvgPool2d,
    # registered on the square roots by dampednewton/backpack/adaptive_pooling.py).
    Problem(
        "cnn-gap-ce",
        models.cnn_global_pool,
        _cross_entropy,
        Classification((4, 1, 6, 6)),
        seed=19,
        tags=_STEP,
    ),
    # Diagnostics: N ≥ 6, ReLU or sigmoid MLPs and a small CNN.
    Problem(
        "mlp-relu-ce-n8",
        models.mlp_relu,
        _cross_entropy,
        Classification((8, 5)),
        seed=10,
        tags=_DIAGNOSTICS,
    ),
    Problem(
        "mlp-relu-mse-n7",
        models.mlp_relu,
        _mse,
        Regression((7, 5)),
        seed=11,
        tags=_DIAGNOSTICS,
    ),
    # [N, 1, 5, 5] -> conv [N, 2, 3, 3] -> flatten [N, 18] -> Linear.
    Problem(
        "cnn-nopool-ce-n6",
        models.cnn_no_pool,
        _cross_entropy,
        Classification((6, 1, 5, 5)),
        seed=12,
        tags=_DIAGNOSTICS,
    ),
    Problem(
        "cnn-nopool-mse-n6",
        models.cnn_no_pool,
        _mse,
        Regression((6, 1, 5, 5)),
        seed=13,
        tags=_DIAGNOSTICS,
    ),
    # Multi-label binary cross-entropy, soft targets: the package's own derivatives.
    Problem(
        "mlp-relu-bce-multilabel-n8",
        models.mlp_relu,
        _bce_with_logits,
        _soft_multilabel_8x5,
        seed=16,
        tags=_DIAGNOSTICS,
    ),
    # GELU (tanh), Softplus and Hardswish: the package's second derivatives enter
    # the Hessian's diagonal.
    Problem(
        "mlp-smooth-mse-n7",
        models.mlp_smooth_branches,
        _mse,
        Regression((7, 5)),
        seed=18,
        tags=_DIAGNOSTICS,
    ),
    # Sigmoid has curvature of its own, so the Hessian differs from the GGN.
    Problem(
        "mlp-sigmoid-ce-n6",
        models.mlp_sigmoid,
        _cross_entropy,
        Classification((6, 5)),
        seed=14,
        tags=_DIAGNOSTICS,
    ),
]
"""Every test problem, each once."""


def tagged(tag: str) -> list[Problem]:
    """The problems of ``CASES`` with a tag, in order."""
    return [problem for problem in CASES if tag in problem.tags]


def case_by_id(problem_id: str) -> Problem:
    """The problem of ``CASES`` with an id.

    Raises:
        KeyError: If no problem has that id.
    """
    for problem in CASES:
        if problem.id == problem_id:
            return problem
    raise KeyError(f"No problem with id {problem_id!r}.")


PROBLEMS = tagged(SIMPLE_SPECTRUM)
DIAGNOSTICS_PROBLEMS = tagged(DIAGNOSTICS)
KRONECKER_PROBLEMS = tagged(KRONECKER)
LINEAR_MSE = case_by_id("linear-mse")


def readme_problem() -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
    """README's optimizer example: extended model and loss, inputs needing no grad."""
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(128, 10, generator=gen)
    y = (X[:, :3].sum(1) > 0).long() + (X[:, 3] > 1).long()
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)))
    return model, extend(nn.CrossEntropyLoss()), X, y
