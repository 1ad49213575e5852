"""The refresh-pass comparison: its two optimizers and its table (on the CPU)."""

from __future__ import annotations

import torch

from benchmarks.micro.harness import make_step
from benchmarks.micro.refresh_pass import main
from benchmarks.micro.step_phases import PHASES, step_kinds
from dampednewton.backpack.autograd_factors import AutogradFactors


def test_the_backpack_variant_keeps_backpacks_pass_for_every_refresh(monkeypatch):
    """The defaults take autograd's pass after the first refresh; it never does."""
    passes: list[str] = []
    loss_ran = AutogradFactors.loss_ran

    def counted(self, loss, inputs, output):
        passes.append(variant)
        loss_ran(self, loss, inputs, output)

    monkeypatch.setattr(AutogradFactors, "loss_ran", counted)
    for variant in ("default", "default:backpack"):
        step = make_step(variant, "mlp-tiny", 16, torch.device("cpu"))
        for _ in range(4):  # refreshes at 0 (BackPACK's), 1 and 3
            step()
    assert passes == ["default", "default"]


def test_the_table_has_every_phase_and_the_sum(capsys):
    main(["--models", "mlp-tiny", "--steps", "50", "--batch-size", "16"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split("|")[1:-1] for line in lines[3:]]
    kinds = step_kinds(50)[1:]
    taken = [phase for phase in PHASES if phase in kinds]  # the defaults': no refresh
    assert [row[1].strip() for row in rows] == [*taken, "all"]
    assert [int(row[2]) for row in rows] == [*map(kinds.count, taken), 49]
    assert all(float(cell) > 0 for row in rows for cell in row[3:])
