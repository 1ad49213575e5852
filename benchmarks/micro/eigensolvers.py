"""The refreshes' solvers on the device against the host: the eigensolver policy.

A refresh that rotates the Kronecker bases solves, per factor shape, a QR of a tall
``[d, r]`` block (one subspace iteration) and a symmetric eigenproblem of at most
``r × r`` (``r = 32`` by default), or of a small factor (``d ≤ r``) whole; the Gram
basis solves an ``NC × NC`` one every step. On a GPU each ``eigh`` is a few cuSOLVER
kernels and a synchronization (its check of the result); on the host it is LAPACK
after one copy, which synchronizes as well. This script times both for those shapes,
float32, the host variant's copies to and from the host included, in alternating
blocks (:func:`~benchmarks.micro.harness.round_robin_medians`), and prints the ratio:
below 1, the host is faster. On a CPU both variants are the same work. ::

    python -m benchmarks.micro.eigensolvers
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from benchmarks.micro.harness import round_robin_medians, script_device

EIGH_SHAPES = ((10,), (32,), (64,), (128,), (6, 32), (512,))
"""``eigh`` problems: a matrix of that size, or a batch ``(L, n)`` of ``L``."""

QR_SHAPES = ((129, 32), (785, 32), (3137, 32))
"""Tall QR problems ``[d, r]`` of a subspace iteration."""


def spd_matrices(size: tuple[int, ...], device: torch.device) -> Tensor:
    """Symmetric positive definite ``[..., n, n]`` test matrices (a local generator)."""
    generator = torch.Generator().manual_seed(sum(size))
    *batch, n = size
    factor = torch.randn(*batch, n, 2 * n, generator=generator)
    product = factor @ factor.mT / (2 * n)
    return ((product + product.mT) / 2).to(device)  # symmetric to the last bit


def tall_block(size: tuple[int, int], device: torch.device) -> Tensor:
    """A random ``[d, r]`` block (a local generator)."""
    generator = torch.Generator().manual_seed(sum(size))
    return torch.randn(*size, generator=generator).to(device)


def on_host(solve: Callable[[Tensor], tuple[Tensor, ...]], matrix: Tensor) -> Callable:
    """``solve`` after a copy to the host, its results copied back to the device."""

    def run() -> tuple[Tensor, ...]:
        results = solve(matrix.cpu())
        return tuple(result.to(matrix.device) for result in results)

    return run


def rows(device: torch.device, repeats: int) -> list[str]:
    """One table row per problem: device and host medians and their ratio."""
    problems: dict[str, tuple[Callable, Tensor]] = {}
    for size in EIGH_SHAPES:
        name = "eigh " + " × ".join(map(str, (*size, size[-1])))
        problems[name] = (torch.linalg.eigh, spd_matrices(size, device))
    for size in QR_SHAPES:
        name = "qr " + " × ".join(map(str, size))
        problems[name] = (torch.linalg.qr, tall_block(size, device))
    lines = []
    for name, (solve, matrix) in problems.items():
        variants = {
            "device": lambda solve=solve, matrix=matrix: solve(matrix),
            "host": on_host(solve, matrix),
        }
        medians = round_robin_medians(variants, device, repeats)
        lines.append(
            f"| {name} | {1e3 * medians['device']:.3f} | {1e3 * medians['host']:.3f} "
            f"| {medians['host'] / medians['device']:.2f} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    device, name = script_device(args.threads)
    print(f"device {name}, float32, host threads {torch.get_num_threads()}")
    print("| problem | device ms | host ms (copies included) | host / device |")
    print("| --- | --- | --- | --- |")
    for line in rows(device, args.repeats):
        print(line)


if __name__ == "__main__":
    main()
