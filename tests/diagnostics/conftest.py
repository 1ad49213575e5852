"""Fixtures of the diagnostics tests: the problem list, built for BackPACK."""

from __future__ import annotations

import pytest

from tests.conftest import Case, build_case
from tests.diagnostics.problems import PROBLEMS


@pytest.fixture(params=PROBLEMS, ids=lambda problem: problem.id)
def case(request) -> Case:
    """Each diagnostics problem, extended for BackPACK and as a plain copy."""
    return build_case(request.param)
