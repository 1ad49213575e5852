"""The eigensolver comparison: its problems and its table (on the CPU)."""

from __future__ import annotations

import torch

from benchmarks.micro.eigensolvers import main, on_host, spd_matrices, tall_block
from tests.assertions import assert_close


def test_the_problems_are_what_the_refreshes_solve():
    for size in [(10,), (6, 32)]:
        matrices = spd_matrices(size, torch.device("cpu"))
        assert matrices.shape == (*size, size[-1])
        assert_close(matrices, matrices.mT, rtol=0, atol=0, name="symmetry")
        assert torch.linalg.eigvalsh(matrices).min() > 0
    assert tall_block((785, 32), torch.device("cpu")).shape == (785, 32)


def test_the_host_variant_solves_the_same_problem():
    matrix = spd_matrices((10,), torch.device("cpu")).double()
    values, vectors = on_host(torch.linalg.eigh, matrix)()
    assert_close(
        vectors @ torch.diag(values) @ vectors.T, matrix, rtol=1e-12, atol=1e-12
    )


def test_the_table_has_a_row_per_problem(capsys):
    main(["--repeats", "8"])
    lines = capsys.readouterr().out.splitlines()
    problems = [line.split("|")[1].strip() for line in lines[3:]]
    assert problems[:2] == ["eigh 10 × 10", "eigh 32 × 32"]
    assert "eigh 6 × 32 × 32" in problems and "qr 3137 × 32" in problems
    assert all(float(line.split("|")[4]) > 0 for line in lines[3:])
