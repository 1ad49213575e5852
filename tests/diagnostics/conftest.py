"""Fixtures of the diagnostics tests: the diagnostics problems, built for BackPACK."""

from __future__ import annotations

import pytest

from tests.cases import DIAGNOSTICS_PROBLEMS, Problem
from tests.utils import Case, build_case


def _problem_id(problem: Problem) -> str:
    return problem.id


@pytest.fixture(params=DIAGNOSTICS_PROBLEMS, ids=_problem_id)
def diagnostics_problem(request: pytest.FixtureRequest) -> Problem:
    """Each problem tagged ``DIAGNOSTICS`` in the declarative list."""
    return request.param


@pytest.fixture
def case(diagnostics_problem: Problem) -> Case:
    """Each diagnostics problem, extended for BackPACK and as a plain copy."""
    return build_case(diagnostics_problem)


@pytest.fixture
def case_on_device(diagnostics_problem: Problem, device: str) -> Case:
    """Each diagnostics problem built on each device of the ``device`` fixture."""
    return build_case(diagnostics_problem, device=device)
