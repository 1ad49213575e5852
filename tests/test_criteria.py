"""Criteria: which eigenvalues they select, and how bad selections are refused."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from dampednewton import EigenvalueThreshold, RelativeThreshold, TopK
from dampednewton.math.linalg import numerical_zero
from dampednewton.policies.criteria import as_criterion, selected_indices

# Ascending, with a negative round-off eigenvalue and a numerically zero one.
EVALS = torch.tensor([-1e-17, 1e-59, 1e-3, 0.2, 0.5, 1.0], dtype=torch.float64)

CASES = [
    ("top-2", TopK(2), [4, 5]),
    ("top-k-larger-than-rank", TopK(10), [2, 3, 4, 5]),
    ("threshold", EigenvalueThreshold(0.1), [3, 4, 5]),
    ("threshold-zero", EigenvalueThreshold(0.0), [2, 3, 4, 5]),
    ("relative-half", RelativeThreshold(0.5), [4, 5]),
    ("relative-all", RelativeThreshold(1e-12), [2, 3, 4, 5]),
    ("relative-one", RelativeThreshold(1.0), [5]),
]


@pytest.mark.parametrize(
    ("criterion", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_selection(criterion, expected):
    assert list(criterion(EVALS)) == expected


def test_numerical_zero_is_round_off_level():
    assert numerical_zero(EVALS) == pytest.approx(6 * torch.finfo(torch.float64).eps)
    assert numerical_zero(torch.tensor([-1.0, -0.5])) == 0.0
    assert numerical_zero(torch.zeros(0)) == 0.0


def test_no_positive_eigenvalue_selects_nothing():
    evals = torch.zeros(4)
    assert TopK(3)(evals) == []
    assert RelativeThreshold(0.5)(evals) == []


def test_int_shorthand_and_callables():
    assert as_criterion(3) == TopK(3)
    custom = lambda evals: [evals.numel() - 1]  # noqa: E731
    assert as_criterion(custom) is custom


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: TopK(0), ValueError),
        (lambda: TopK(2.5), TypeError),
        (lambda: as_criterion(0), ValueError),
        (lambda: as_criterion(True), TypeError),
        (lambda: as_criterion("top"), TypeError),
        (lambda: EigenvalueThreshold(-1.0), ValueError),
        (lambda: RelativeThreshold(0.0), ValueError),
        (lambda: RelativeThreshold(1.5), ValueError),
        (lambda: EigenvalueThreshold("1e-3"), TypeError),
        (lambda: EigenvalueThreshold(True), TypeError),
        (lambda: RelativeThreshold("0.5"), TypeError),
    ],
    ids=[
        "k=0",
        "k-float",
        "shorthand-0",
        "bool",
        "string",
        "negative",
        "zero",
        ">1",
        "string-threshold",
        "bool-threshold",
        "string-fraction",
    ],
)
def test_invalid_criteria(make, error):
    with pytest.raises(error):
        make()


@pytest.mark.parametrize(
    ("indices", "error", "match"),
    [
        ([6], IndexError, "only 6 eigenvalues"),
        ([-7], IndexError, "only 6 eigenvalues"),
        ([5, 5], ValueError, "repeated"),
    ],
    ids=["too-large", "too-negative", "repeated"],
)
def test_selected_indices_refuses(indices, error, match):
    with pytest.raises(error, match=match):
        selected_indices(lambda evals: indices, EVALS)


def test_selected_indices_normalizes_negative_and_unsorted():
    assert selected_indices(lambda evals: [-1, 3], EVALS).tolist() == [3, 5]


@pytest.mark.parametrize(
    "criterion", [TopK(2), EigenvalueThreshold(0.1), RelativeThreshold(0.3)], ids=str
)
def test_criteria_round_trip(criterion):
    assert pickle.loads(pickle.dumps(criterion)) == criterion
    buffer = io.BytesIO()
    torch.save({"criterion": criterion}, buffer)
    buffer.seek(0)
    assert torch.load(buffer)["criterion"] == criterion


def test_selected_indices_accepts_non_positive_eigenvalues():
    """ViViT's keep-all criterion: the computations warn about these, not refuse."""
    keep_all = lambda evals: list(range(evals.numel()))  # noqa: E731
    assert selected_indices(keep_all, EVALS).tolist() == list(range(6))


def test_a_zero_threshold_selects_no_round_off_eigenvalue():
    """EigenvalueThreshold(0) keeps the numerically positive eigenvalues only."""
    evals = torch.tensor([-1e-9, 1e-12, 3e-9, 0.5, 2.0], dtype=torch.float32)
    assert EigenvalueThreshold(0.0)(evals) == [3, 4]
    assert 3e-9 < numerical_zero(evals).item()
