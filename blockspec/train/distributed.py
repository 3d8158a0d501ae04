"""Data-parallel training over the processes `torchrun` starts (one per GPU; gloo on CPU).
Each rank generates its share of the data and trains on its share of every step's batch; the
loss is normalised by the whole batch's weight and the gradients are summed, so a step equals
the single-process step over the whole batch."""

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    waits: object = None  # process group of the barriers, with a timeout long enough for data generation

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over ranks in place (and returns it)."""
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """One all-reduce over every gradient, flattened (small tensors reduce badly one by one)."""
        if self.size == 1:
            return
        grads = [p.grad for p in params]
        flat = self.all_sum(torch.cat([g.reshape(-1) for g in grads]))
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.waits)


SINGLE = World()  # one process alone


def init_world(device: torch.device) -> tuple[World, torch.device]:
    """The world `torchrun` describes in the environment (one process alone: rank 0 of 1) and
    this rank's device (cuda:LOCAL_RANK on GPUs)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return SINGLE, device
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=size)
    # Ranks wait for each other at the end of data generation, which takes minutes to hours; a
    # collective of training keeps the default timeout, so a rank that died is noticed soon.
    waits = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=6))
    return World(rank, size, waits), device


def close_world(world: World) -> None:
    if world.size > 1:
        dist.destroy_process_group()
