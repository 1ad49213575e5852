"""The micro-benchmarks' one harness: their models, their steps and how they are timed.

:data:`MODELS` are the networks of the performance issue on random inputs;
:func:`make_step` builds one closure-driven step of a variant (``sgd``, ``adam``,
the peers ``soap`` and ``kron``, ``fast:<ggn>``, ``dense:<ggn>``, ``default``,
``default:exact``, ``default:per_layer``, ``default:packed``, ``default:graphed``, and
the defaults with fewer refreshes ``default:interval30`` and fewer rotations
``default:rotation3``);
:func:`time_blocks` and :func:`round_robin_medians` time variants in alternating
blocks of consecutive steps, synchronized by :class:`benchmarks.measure.Stopwatch`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from backpack import backpack, extend
from torch import Tensor, nn
from torch.optim import Optimizer

from benchmarks.measure import Stopwatch
from benchmarks.problems.models import cifar10_3c3d, mlp
from dampednewton import (
    DampedNewton,
    DirectionalDampedNewtonComputation,
    GramBasis,
    KroneckerBasis,
    basis_defaults,
)

NUM_CLASSES = 10
DIRECTIONS = 10
DEFAULT_AVERAGING = basis_defaults(KroneckerBasis())["averaging"]
"""The defaults' refresh schedule (``default:interval30`` stretches its interval)."""


def flat_mlp(hidden: tuple[int, ...]) -> Callable[[], nn.Module]:
    """Factory of a ReLU MLP 784-hidden-10 on flattened 28×28 inputs."""

    def build() -> nn.Module:
        generator = torch.Generator().manual_seed(0)
        return nn.Sequential(
            nn.Flatten(), mlp(784, hidden, NUM_CLASSES, "relu", generator=generator)
        )

    return build


def tiny_mlp() -> nn.Module:
    """The outside 6-class task's kind of model: tanh MLP 20-64-64-10."""
    generator = torch.Generator().manual_seed(0)
    return mlp(20, (64, 64), NUM_CLASSES, "tanh", generator=generator)


def cnn() -> nn.Module:
    """conv(16,5)-pool-conv(32,5)-pool-fc128-fc10 on 1×28×28 inputs."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, NUM_CLASSES),
    )


def deepobs_3c3d() -> nn.Module:
    """DeepOBS's cifar10_3c3d (ViViT's memory benchmark) on 3×32×32 inputs."""
    return cifar10_3c3d(NUM_CLASSES, generator=torch.Generator().manual_seed(0))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp-tiny": tiny_mlp,
    "mlp": flat_mlp((128, 128)),
    "mlp-large": flat_mlp((512, 512)),
    "mlp-deep": flat_mlp((128,) * 16),
    "cnn": cnn,
    "3c3d": deepobs_3c3d,
}
INPUT_SHAPES: dict[str, tuple[int, ...]] = {"3c3d": (3, 32, 32), "mlp-tiny": (20,)}
"""A model's input shape, where it is not 1×28×28."""


def input_shape(model_name: str) -> tuple[int, ...]:
    """The shape of one input of a model of :data:`MODELS`."""
    return INPUT_SHAPES.get(model_name, (1, 28, 28))


def script_device(threads: int | None) -> tuple[torch.device, str]:
    """A script's device (CUDA when present) and its name, torch's threads set first.

    Args:
        threads: Intra-op threads (``None``: torch's default).

    Returns:
        The device and its name (``CPU`` for the CPU).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return device, name


def time_blocks(
    steps: Mapping[str, Callable[[], object]],
    device: torch.device,
    rounds: int,
    warmup: int,
    repeats: int,
) -> dict[str, list[float]]:
    """Seconds of every timed step of each variant.

    Each round runs every variant in a block of ``warmup`` untimed and ``repeats``
    timed consecutive steps, as in a training loop (warm caches). Blocks, not single
    steps, alternate between the variants, so a changing load on a shared machine
    affects all of them alike while no variant is timed right after another one
    evicted its memory.

    Args:
        steps: The step of each variant.
        device: The device whose queued work every reading waits for.
        rounds: Blocks per variant.
        warmup: Untimed steps at the start of each block.
        repeats: Timed steps in each block.

    Returns:
        The ``rounds * repeats`` step times of each variant, in seconds.
    """
    stopwatch = Stopwatch(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            for _ in range(warmup):
                step()
            for _ in range(repeats):
                stopwatch.start()
                step()
                times[name].append(stopwatch.stop())
    return times


def round_robin_medians(
    steps: Mapping[str, Callable[[], object]],
    device: torch.device,
    repeats: int,
    rounds: int = 8,
) -> dict[str, float]:
    """Median seconds per step of each variant, timed in alternating blocks.

    Every round runs each variant for one untimed warm-up step and then
    ``⌈repeats / rounds⌉`` timed steps in a row (:func:`time_blocks`).
    """
    per_round = -(-repeats // rounds)
    times = time_blocks(steps, device, rounds, warmup=1, repeats=per_round)
    return {name: statistics.median(values) for name, values in times.items()}


def plain_step(
    optimizer: Optimizer, model: nn.Module, loss_fn: nn.Module, X: Tensor, y: Tensor
) -> Callable[[], None]:
    """One step on a fixed batch: zero the gradients, forward, backward, ``step()``."""

    def step() -> None:
        optimizer.zero_grad()
        loss_fn(model(X), y).backward()
        optimizer.step()

    return step


def closure_step(
    optimizer: DampedNewton, model: nn.Module, loss_fn: nn.Module, X: Tensor, y: Tensor
) -> Callable[[], object]:
    """One ``optimizer.step(closure)`` on a fixed batch; the closure runs the pass."""

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        return loss

    return lambda: optimizer.step(closure)


PEERS = ("soap", "kron")
"""Curvature peers from ``pytorch-optimizer`` (the ``bench`` extra)."""


def peer(name: str, model: nn.Module) -> Optimizer:
    """SOAP (eigenbasis every 10 steps) or PSGD-Kron, as the sweeps configure them."""
    import pytorch_optimizer

    if name == "soap":
        return pytorch_optimizer.SOAP(
            model.parameters(), lr=1e-3, weight_decay=0.0, precondition_frequency=10
        )
    return pytorch_optimizer.Kron(model.parameters(), lr=1e-3, weight_decay=0.0)


VARIANT_KINDS = ("sgd", "adam", *PEERS, "fast", "dense", "default")
"""The kinds of step :func:`make_step` builds (``kind:ggn``)."""
GGN_KINDS = {"fast": ("mc1", "exact"), "dense": ("mc1", "exact")}
DEFAULT_KINDS = (
    "",
    "mc1",
    "exact",
    "per_layer",
    "packed",
    "graphed",
    "backpack",
    "interval30",
    "rotation3",
)


def check_variant(kind: str, ggn: str) -> None:
    """Refuse a variant :func:`make_step` does not build (a typo would run another).

    Raises:
        ValueError: Naming the variants there are.
    """
    allowed = GGN_KINDS.get(kind, DEFAULT_KINDS if kind == "default" else ("",))
    if kind not in VARIANT_KINDS or ggn not in allowed:
        raise ValueError(
            f"Unknown step variant {kind}:{ggn}. Variants: sgd, adam, "
            f"{', '.join(PEERS)}, fast:mc1, fast:exact, dense:mc1, dense:exact, "
            "default, default:exact, default:per_layer, default:packed, "
            "default:graphed, default:backpack, default:interval30, "
            "default:rotation3."
        )


def make_step(variant: str, model_name: str, batch_size: int, device: torch.device):
    """Build model, data and a closure-driven step for one variant."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # benchmark script: module initialization only
    model = MODELS[model_name]().to(device)
    loss_fn = nn.CrossEntropyLoss()
    X = torch.randn(batch_size, *input_shape(model_name), generator=generator)
    X = X.to(device)
    y = torch.randint(NUM_CLASSES, (batch_size,), generator=generator).to(device)
    kind, _, ggn = variant.partition(":")
    check_variant(kind, ggn)
    mc_samples = 1 if ggn == "mc1" else 0
    if kind in ("sgd", "adam"):
        plain = (
            torch.optim.SGD(model.parameters(), lr=1e-3)
            if kind == "sgd"
            else torch.optim.Adam(model.parameters(), lr=1e-3)
        )
        return plain_step(plain, model, loss_fn, X, y)
    if kind in PEERS:
        return plain_step(peer(kind, model), model, loss_fn, X, y)
    model, loss_fn = extend(model), extend(loss_fn)
    if kind in ("fast", "default"):
        vivit = {
            "basis": GramBasis(),
            "damping": 1e-2,
            "criterion": DIRECTIONS,
            "mc_samples": mc_samples,
            "complement": None,
            "newton_fraction": 1.0,
            "averaging": None,
            "kl_clip": None,
        }
        # The defaults draw one Monte-Carlo sample (on a CUDA device packed and
        # graphed); ``default:exact`` the exact GGN; ``default:per_layer`` steps the
        # layers by shape (the CPU's default), ``default:packed`` every layer in one
        # padded batch, ``default:graphed`` replays that batch's math as a CUDA graph;
        # ``default:backpack`` refreshes through BackPACK's pass every time (the
        # optimizer's private switch: the defaults' later refreshes take autograd's);
        # ``default:interval30`` refreshes every 30 steps past the ramp (the default:
        # 15), ``default:rotation3`` rotates the eigenbases on every third refresh
        # (the others refresh the eigenvalues along the kept eigenvectors).
        changed: dict[str, dict[str, Any]] = {
            "exact": {"mc_samples": 0},
            "interval30": {"averaging": replace(DEFAULT_AVERAGING, interval=30)},
            "rotation3": {"basis": KroneckerBasis(rotation_interval=3)},
            "per_layer": {"basis": KroneckerBasis(packed=False)},
            "packed": {"basis": KroneckerBasis(packed=True, graphed=False)},
            "graphed": {"basis": KroneckerBasis(packed=True, graphed=True)},
        }
        settings = {"seed": 0, **changed.get(ggn, {})} if kind == "default" else vivit
        optimizer = DampedNewton(model.parameters(), lr=1e-3, **settings)
        optimizer._pipeline.kronecker._passes.autograd = ggn != "backpack"
        return closure_step(optimizer, model, loss_fn, X, y)
    params = list(model.parameters())
    group = {"params": params, "criterion": DIRECTIONS, "damping": 1e-2}

    def materialized_step() -> None:
        computation = DirectionalDampedNewtonComputation(
            mc_samples_ggn=mc_samples, structured=False
        )
        hook = computation.get_extension_hook([group])
        for p in params:
            p.grad = None
        with backpack(*computation.get_extensions(), extension_hook=hook):
            loss_fn(model(X), y).backward()
        with torch.no_grad():
            for p, s in zip(params, computation.get_result(group), strict=True):
                p.add_(s, alpha=1e-3)

    return materialized_step
