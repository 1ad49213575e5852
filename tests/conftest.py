"""Fixtures and hooks of the whole suite: threads, problems, block structures."""

from __future__ import annotations

import pytest
import torch

from tests.cases import PROBLEMS, Problem


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread per test process.

    ``make test`` runs one pytest worker per core; torch's default of one thread per
    core would oversubscribe the machine, and busy-waiting OpenMP threads then slow
    small operations down by an order of magnitude.
    """
    torch.set_num_threads(1)


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
