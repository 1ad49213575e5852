"""Shared fixtures: the declarative problem list, built for BackPACK and reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from backpack import extend
from torch import Tensor, nn

from tests.problems import PROBLEMS, Problem


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread per test process.

    ``make test`` runs one pytest worker per core; torch's default of one thread per
    core would oversubscribe the machine, and busy-waiting OpenMP threads then slow
    small operations down by an order of magnitude.
    """
    torch.set_num_threads(1)


@dataclass
class Case:
    """A problem built twice: BackPACK-extended, and plain for the references.

    Attributes:
        model: Extended model.
        loss_fn: Extended loss function.
        reference_model: Plain copy with equal parameters.
        reference_loss_fn: Plain loss function.
        X: Inputs.
        y: Targets.
    """

    model: nn.Module
    loss_fn: nn.Module
    reference_model: nn.Module
    reference_loss_fn: nn.Module
    X: Tensor
    y: Tensor

    def reference_params(self, params: list[Tensor]) -> list[Tensor]:
        """Return the reference model's parameters matching ``params``."""
        index = {id(p): i for i, p in enumerate(self.model.parameters())}
        reference = list(self.reference_model.parameters())
        return [reference[index[id(p)]] for p in params]


def build_case(problem: Problem, dtype: torch.dtype = torch.float64) -> Case:
    """Build a problem for BackPACK and for the brute-force references."""
    model, loss_fn, X, y = problem.build(dtype)
    reference_model, reference_loss_fn, _, _ = problem.build(dtype)
    return Case(
        extend(model), extend(loss_fn), reference_model, reference_loss_fn, X, y
    )


@pytest.fixture(params=PROBLEMS, ids=lambda problem: problem.id)
def problem(request) -> Problem:
    """Each problem of the declarative list."""
    return request.param


@pytest.fixture(params=["full", "per-layer"])
def block_structure(request) -> str:
    """One GGN block for the whole network, or one per parameter."""
    return request.param


def make_groups(model: nn.Module, structure: str, **keys) -> list[dict]:
    """Parameter groups for a block structure, each with the given extra keys."""
    params = list(model.parameters())
    if structure == "full":
        return [{"params": params, **keys}]
    return [{"params": [p], **keys} for p in params]
