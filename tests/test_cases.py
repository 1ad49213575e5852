"""Self-tests of the declarative test problems: ids, builds, sizes and spectra."""

from __future__ import annotations

import pickle

import pytest
import torch

from tests import reference
from tests.assertions import assert_close
from tests.cases import CASES, DIAGNOSTICS, PROBLEMS
from tests.utils import full_group, num_nonzero

ALL_PROBLEMS = CASES
ALL_IDS = [problem.id for problem in ALL_PROBLEMS]

parametrize_problems = pytest.mark.parametrize(
    "problem", PROBLEMS, ids=[problem.id for problem in PROBLEMS]
)
parametrize_all_problems = pytest.mark.parametrize("problem", ALL_PROBLEMS, ids=ALL_IDS)


def test_problem_ids_are_unique():
    ids = [problem.id for problem in CASES]
    assert len(set(ids)) == len(ids)


@parametrize_all_problems
def test_build_is_deterministic_fresh_and_leaves_global_rng_alone(problem):
    rng_state = torch.get_rng_state()
    model1, _, X1, y1 = problem.build()
    model2, _, X2, y2 = problem.build()
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert torch.equal(X1, X2)
    assert torch.equal(y1, y2)
    for p1, p2 in zip(model1.parameters(), model2.parameters(), strict=True):
        assert p1 is not p2
        assert p1.dtype == torch.float64
        assert torch.equal(p1, p2)


@parametrize_all_problems
def test_build_casts_to_dtype(problem):
    model64, _, X64, y64 = problem.build()
    model32, _, X32, y32 = problem.build(torch.float32)
    assert X32.dtype == torch.float32
    assert_close(X32, X64.float(), rtol=0, atol=0, name="X")
    if y64.is_floating_point():
        assert_close(y32, y64.float(), rtol=0, atol=0, name="y")
    else:
        assert torch.equal(y32, y64)
    for p32, p64 in zip(model32.parameters(), model64.parameters(), strict=True):
        assert_close(p32, p64.float(), rtol=0, atol=0, name="parameter")


def test_build_rejects_integer_dtype():
    with pytest.raises(ValueError, match="floating-point"):
        PROBLEMS[0].build(torch.int64)


@parametrize_all_problems
def test_problem_is_tiny(problem):
    model, _, params, X, _ = full_group(problem)
    outputs = model(X)
    if DIAGNOSTICS in problem.tags:
        assert 6 <= X.shape[0] <= 8, "the debiased GSNR needs a few samples"
    else:
        assert 4 <= X.shape[0] <= 6
    assert outputs.shape in ((X.shape[0], 3), (X.shape[0], 1))
    # The convolution with few positions needs enough channels to be structured.
    assert sum(p.numel() for p in params) <= 450


def test_problems_are_picklable():
    restored = pickle.loads(pickle.dumps(ALL_PROBLEMS))
    for original, copy in zip(ALL_PROBLEMS, restored, strict=True):
        assert copy == original
        assert torch.equal(copy.build()[2], original.build()[2])


@parametrize_problems
def test_nonzero_eigenvalues_are_simple_and_not_small(problem):
    evals = torch.linalg.eigvalsh(reference.ggn(*full_group(problem)))
    nonzero = evals[-num_nonzero(evals) :]
    assert nonzero.min() > 1e-4, "eigenvalues must stay above the warning threshold"
    relative_gaps = (nonzero[1:] - nonzero[:-1]) / nonzero[1:]
    assert relative_gaps.min() > 1e-3, "eigenvectors must be unique up to sign"
