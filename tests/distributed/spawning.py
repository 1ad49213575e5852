"""Spawned gloo ranks for the distributed tests: one launcher for every worker."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def spawn_ranks(
    run_rank: Callable[..., None], job: Any, world_size: int, tmp_path: Path
) -> list[Any]:
    """Run ``run_rank(rank, world_size, init_file, out, job)`` on spawned ranks.

    Args:
        run_rank: A worker's entry point; it saves its results to ``out/<rank>.pt``.
        job: What the ranks run (picklable).
        world_size: Number of ranks.
        tmp_path: A fresh directory for the rendezvous file and the results.

    Returns:
        What each rank saved, by rank.
    """
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(
        run_rank,
        args=(world_size, str(tmp_path / "rendezvous"), str(out), job),
        nprocs=world_size,
    )
    # Written by this test's ranks: records of floats and tensors, not only weights.
    return [
        torch.load(out / f"{rank}.pt", weights_only=False) for rank in range(world_size)
    ]
