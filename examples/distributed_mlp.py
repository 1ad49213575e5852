"""Data-parallel DampedNewton: ``torchrun --nproc-per-node 2 examples/distributed_mlp.py``.

Every rank trains the same MLP (DistributedDataParallel averages the gradients) on its
shard of each global batch; DampedNewton gathers what the step needs from the ranks,
so every rank takes the step of the global batch. The example checks that: each rank
also trains a single-process twin on the whole global batches, and both end with the
same parameters. Run without ``torchrun`` it trains on one process.
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
from backpack import extend
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dampednewton import DampedNewton

GLOBAL_BATCH, STEPS = 64, 20


def train(rows: slice, ddp: bool, process_group=None) -> tuple[nn.Module, list[float]]:
    """Train on the rows ``rows`` of every global batch; return model and losses."""
    torch.manual_seed(0)  # the same initial model on every rank
    model = extend(nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4)))
    stepped = DistributedDataParallel(model) if ddp else model
    loss_fn = extend(nn.CrossEntropyLoss())
    optimizer = DampedNewton(
        model.parameters(), damping=0.1, mc_samples=0, process_group=process_group
    )
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        inputs = torch.randn(GLOBAL_BATCH, 10, generator=data)
        targets = (inputs[:, :4].argmax(1) + (inputs[:, 4] > 1).long()) % 4
        x, y = inputs[rows], targets[rows]

        def closure(x=x, y=y):
            optimizer.zero_grad()
            loss = loss_fn(stepped(x), y)
            loss.backward()
            return loss

        losses.append(optimizer.step(closure).item())  # the mean over the ranks
    return model, losses


def main() -> None:
    """Train data-parallel and alone; check and print on rank 0."""
    distributed = "RANK" in os.environ
    if not distributed:
        _, losses = train(slice(None), ddp=False)
        print(f"one process: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        assert losses[-1] < losses[0], losses  # 1.39 -> 0.80 here
        return
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Every rank creates every one-rank group (a collective); each trains in its own.
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    local = GLOBAL_BATCH // world_size
    model, losses = train(slice(rank * local, (rank + 1) * local), ddp=True)
    twin, twin_losses = train(slice(None), ddp=False, process_group=alone)
    for param, twin_param in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(param, twin_param, rtol=1e-4, atol=1e-5)
    if rank == 0:
        print(
            f"{world_size} ranks: loss {losses[0]:.4f} -> {losses[-1]:.4f}; one "
            f"process on the global batches: {twin_losses[0]:.4f} -> "
            f"{twin_losses[-1]:.4f}; the same parameters"
        )
    dist.barrier()  # no rank closes its group while another still reads from it
    # DDP's reducer sits in a reference cycle that holds the group: free it before
    # the group, not at interpreter teardown, where gloo's threads can abort a rank.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
