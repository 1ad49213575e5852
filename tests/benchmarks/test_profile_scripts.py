"""The step profile counts reads and operators; the critical batch bisects correctly."""

from __future__ import annotations

import pytest
import torch

from benchmarks.micro.critical_batch import largest_fitting, main
from benchmarks.micro.step_profile import main as profile_main
from benchmarks.micro.step_profile import table


def _rows(lines: list[str]) -> dict[str, list[str]]:
    cells = [
        [cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]
    ]
    return {row[1]: row for row in cells}


@pytest.mark.slow
def test_step_profile_counts_the_reads_of_each_variant_on_the_cpu():
    rows = _rows(table(["mlp"], ["mc1"], 16, torch.device("cpu"), repeats=2))
    assert list(rows) == ["sgd", "adam", "fast:mc1", "default", "default:packed"]
    sgd, fast = rows["sgd"], rows["fast:mc1"]
    assert sgd[5] == "0"
    # The step's one read, and the CPU's check of float32 eigh before a retry.
    assert fast[5] == "2"
    assert int(fast[4]) > int(sgd[4]) > 0
    assert (fast[6], fast[7]) == ("—", "—")  # CUDA-only columns
    assert float(fast[3].rstrip("×")) > 1
    assert float(fast[8]) > 0 and sgd[9] == "1.0×"  # the amortized mean, its ratio


@pytest.mark.slow
def test_step_profile_adds_the_exact_ggn_default_with_exact():
    # The exact ViViT step is slow on the CPU: the counts of one step, N=8.
    rows = _rows(table(["mlp"], ["exact"], 8, torch.device("cpu"), repeats=1))
    assert list(rows) == [
        "sgd",
        "adam",
        "fast:exact",
        "default",
        "default:packed",
        "default:exact",
    ]
    assert rows["default:exact"][5] == rows["default"][5] == "1"  # the one read
    assert rows["default:packed"][5] == "1"
    # One padded batch: fewer operators than layer by layer (the MLP's 3 shapes).
    assert int(rows["default:packed"][4]) < int(rows["default"][4])


@pytest.mark.parametrize("limit", [1, 15, 16, 17, 100, 1000, 4096])
def test_largest_fitting_finds_the_largest_multiple_that_fits(limit):
    tried = []

    def fits(batch_size):
        tried.append(batch_size)
        return batch_size <= limit

    found = largest_fitting(fits, start=16, resolution=16)
    assert found == limit // 16 * 16
    assert all(n % 16 == 0 for n in tried)


def test_largest_fitting_refuses_a_start_off_the_grid():
    with pytest.raises(ValueError, match="multiple of resolution"):
        largest_fitting(lambda n: True, start=10, resolution=16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_critical_batch_needs_cuda():
    with pytest.raises(SystemExit, match="needs CUDA"):
        main([])


@pytest.mark.cuda
def test_critical_batch_of_sgd_on_the_mlp(capsys):
    # About 6 kB a sample beside CUDA's own workspaces (cuBLAS's took the whole of a
    # 50 MiB cap on an H100: no batch fitted): under 0.25 GiB about 40,000 samples
    # fit, found in ~6 trials of one process each from 8192.
    command = ["--model", "mlp", "--variants", "sgd", "--cap-gib", "0.25"]
    main([*command, "--start", "8192", "--resolution", "8192"])
    rows = [line for line in capsys.readouterr().out.splitlines() if "| sgd |" in line]
    (row,) = rows
    assert 8192 <= int(row.split("|")[2]) < 2**17


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_an_amortized_default_step_stays_within_the_launch_budget(model):
    """Issue 24's budget: ≤ 2× Adam's ATen operators and ≤ 1 host read per step.

    Averaged over 45 steps past the refresh schedule's ramp (one period of its
    pattern: three refreshes, one of which rotates the eigenvectors, and the steps
    between them), as an amortized step is. Counts, not times: the same on every
    machine.
    """
    lines = table([model], [], 16, torch.device("cpu"), repeats=1, warmup=60, steps=45)
    rows = _rows(lines)
    adam, default = rows["adam"], rows["default"]
    assert int(default[4]) <= 2 * int(adam[4]), (default, adam)
    assert int(default[5]) <= 1


@pytest.mark.slow
def test_step_profile_counts_the_curvature_peers():
    """SOAP and PSGD-Kron from pytorch-optimizer, as the sweeps configure them."""
    lines = table(
        ["mlp"],
        [],
        16,
        torch.device("cpu"),
        repeats=1,
        warmup=2,
        peers=("soap", "kron"),
    )
    rows = _rows(lines)
    assert list(rows) == ["sgd", "adam", "soap", "kron", "default", "default:packed"]
    for peer in ("soap", "kron"):
        assert int(rows[peer][4]) > int(rows["adam"][4]) > 0


@pytest.mark.slow
def test_step_profile_compares_the_refresh_schedules():
    """Fewer refreshes, or fewer rotations, issue fewer operators per amortized step.

    Over 90 steps past the ramp the defaults refresh six times, every refresh
    rotating; every 30 steps three times; rotating on every third refresh, two of the
    six rotate. Counts, not times.
    """
    chosen = ["sgd", "default", "default:interval30", "default:rotation3"]
    lines = table(
        ["mlp"], [], 16, torch.device("cpu"), 1, warmup=60, steps=90, chosen=chosen
    )
    rows = _rows(lines)
    assert list(rows) == chosen
    default = int(rows["default"][4])
    assert int(rows["default:interval30"][4]) < default
    assert int(rows["default:rotation3"][4]) < default
    assert all(rows[name][5] == "1" for name in chosen[1:])  # one read each


def test_step_profile_refuses_variants_without_sgd_or_unknown(capsys):
    with pytest.raises(SystemExit):
        profile_main(["--variants", "adam", "default"])
    assert "needs sgd" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Unknown step variant default:every30"):
        profile_main(["--variants", "sgd", "default:every30"])


def test_the_fewer_refreshes_variant_stretches_the_defaults_schedule():
    from benchmarks.micro.harness import DEFAULT_AVERAGING
    from dampednewton import DampedNewton

    optimizer = DampedNewton([torch.zeros(1, requires_grad=True)])
    assert optimizer.param_groups[0]["averaging"] == DEFAULT_AVERAGING
    with pytest.raises(ValueError, match="sgd among the chosen"):
        table(["mlp"], [], 8, torch.device("cpu"), 1, chosen=["default"])
