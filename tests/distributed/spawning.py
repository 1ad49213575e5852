"""Spawned gloo ranks for the distributed tests: one launcher for every worker."""

from __future__ import annotations

import datetime
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=120)
"""How long a rank waits for the others in a collective before failing its test."""


@contextmanager
def process_group(rank: int, world_size: int, init_file: str) -> Iterator[None]:
    """A rank's gloo process group for the block, torn down in the same order always.

    On exit, after an error too: the garbage collector first, so that DDP's
    reducer, the group it holds and its communication hooks' futures (reference
    cycles) die while the group still exists, not at interpreter teardown, where
    gloo's threads aborted ranks with SIGABRT ("terminate called without an active
    exception": the two-rank bytes test, then the monitor's Monte-Carlo trace
    test, whose workers lacked this); then the group.
    """
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=TIMEOUT,  # a rank left waiting fails the test
    )
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()


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
