"""Data-parallel DampedNewton: ``torchrun --nproc-per-node 2 examples/distributed_mlp.py``.

Every rank trains the same MLP (DistributedDataParallel averages the gradients) on its
shard of each global batch; DampedNewton gathers the layers' BackPACK buffers, so
every rank takes the step of the global batch. Run without ``torchrun`` it trains
on one process; the printed losses match.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from backpack import extend
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dampednewton import DampedNewton

GLOBAL_BATCH, STEPS = 64, 20


def main() -> None:
    """Train on synthetic data and print the global loss on rank 0."""
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    torch.manual_seed(0)  # the same initial model on every rank
    model = extend(nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4)))
    stepped = DistributedDataParallel(model) if distributed else model
    loss_fn = extend(nn.CrossEntropyLoss())
    optimizer = DampedNewton(
        model.parameters(), damping=0.1, criterion=8, mc_samples=0
    )
    local = GLOBAL_BATCH // world_size
    rows = slice(rank * local, (rank + 1) * local)
    data = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        inputs = torch.randn(GLOBAL_BATCH, 10, generator=data)
        targets = (inputs[:, :4].argmax(1) + (inputs[:, 4] > 1).long()) % 4
        x, y = inputs[rows], targets[rows]

        def closure(x=x, y=y):
            optimizer.zero_grad()
            loss = loss_fn(stepped(x), y)
            loss.backward()
            return loss

        loss = optimizer.step(closure)  # the mean over ranks
        if rank == 0 and step % 5 == 4:
            print(f"step {step + 1}: loss {loss.item():.4f}")
    if distributed:
        dist.barrier()  # no rank closes its group while another still reads from it
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
