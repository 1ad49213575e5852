"""The bounded thread count of small solves: applied, restored, same results."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dampednewton import DampedNewton, threads
from dampednewton.math.linalg import symmetric_eigh
from tests.cases import PROBLEMS
from tests.utils import assert_parameters_equal, build_case, make_closure

TWO = 2


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two intra-op threads in this test (the test processes run on one)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(TWO)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def bound() -> Iterator[None]:
    """Restore the module's setting after tests that switch it off."""
    setting = threads.SMALL_MATRIX_THREADS
    yield
    threads.SMALL_MATRIX_THREADS = setting


def test_limited_threads_restores_the_count(two_threads):
    with threads.limited_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == TWO


def test_limited_threads_restores_the_count_after_an_exception(two_threads):
    with pytest.raises(torch.linalg.LinAlgError), threads.limited_threads(1):
        assert torch.get_num_threads() == 1
        raise torch.linalg.LinAlgError("raised inside the bounded block")
    assert torch.get_num_threads() == TWO


def test_limited_threads_never_raises_the_count(two_threads):
    with threads.limited_threads(8):
        assert torch.get_num_threads() == TWO


def test_limited_threads_refuses_zero():
    with pytest.raises(ValueError, match=">= 1"), threads.limited_threads(0):
        pass


def test_only_small_cpu_matrices_are_bounded(two_threads, bound):
    small = torch.zeros(threads.SMALL_MATRIX_SIZE, threads.SMALL_MATRIX_SIZE)
    large = torch.zeros(threads.SMALL_MATRIX_SIZE + 1, 1)
    with threads.small_matrix_threads(small):
        assert torch.get_num_threads() == threads.SMALL_MATRIX_THREADS == 1
    with threads.small_matrix_threads(large):
        assert torch.get_num_threads() == TWO
    threads.SMALL_MATRIX_THREADS = None
    with threads.small_matrix_threads(small):
        assert torch.get_num_threads() == TWO
    assert torch.get_num_threads() == TWO


def test_eigh_restores_the_count_when_it_fails(two_threads):
    with pytest.raises(torch.linalg.LinAlgError, match="did not converge"):
        symmetric_eigh(torch.full((3, 3), torch.nan, dtype=torch.float64))
    assert torch.get_num_threads() == TWO


def test_step_is_identical_with_and_without_the_bound(two_threads, bound):
    """Bitwise: the bound only changes how many threads run the small solves."""
    params = []
    for setting in (1, None):
        threads.SMALL_MATRIX_THREADS = setting
        case = build_case(PROBLEMS[0])
        optimizer = DampedNewton(case.model.parameters(), seed=0)
        closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
        for _ in range(3):
            optimizer.step(closure)
        assert torch.get_num_threads() == TWO
        params.append(list(case.model.parameters()))
    assert_parameters_equal(*params)
