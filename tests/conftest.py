"""Fixtures and hooks of the whole suite: threads, markers, problems, devices."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.cases import PROBLEMS, Problem

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
"""The devices of the core float64 correctness tests; CUDA ones carry ``cuda``."""


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread per test process.

    ``make test`` runs one pytest worker per core; torch's default of one thread per
    core would oversubscribe the machine, and busy-waiting OpenMP threads then slow
    small operations down by an order of magnitude.
    """
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip the tests marked ``cuda`` where no CUDA device is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def _problem_id(problem: Problem) -> str:
    return problem.id


@pytest.fixture(params=PROBLEMS, ids=_problem_id)
def problem(request: pytest.FixtureRequest) -> Problem:
    """Each problem tagged ``SIMPLE_SPECTRUM`` in the declarative list."""
    return request.param


@pytest.fixture(params=["full", "per-layer"])
def block_structure(request: pytest.FixtureRequest) -> str:
    """One GGN block for the whole network, or one per parameter."""
    return request.param


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> Iterator[str]:
    """The CPU, and a CUDA device (tests marked ``cuda``, skipped without one).

    On CUDA, TensorFloat-32 is switched off for the test, so float32 products and
    convolutions keep float32's precision, as on the CPU.
    """
    if request.param != "cuda":
        yield request.param
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    try:
        yield request.param
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved
