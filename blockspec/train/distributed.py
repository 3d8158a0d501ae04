"""Data-parallel training over the processes `torchrun` starts (one per GPU; gloo on CPU).
Each rank generates its share of the data and trains on its share of every step's batch through
torch's DistributedDataParallel, which averages the gradients over ranks; each rank's loss is
normalised by the whole batch's weight and multiplied by the number of ranks, so a step equals
the single-process step over the whole batch."""

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


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


def data_parallel(module: nn.Module, world: World) -> nn.Module:
    """`module` wrapped so that its backward averages the gradients over the ranks (bucketed, while
    the backward still runs); alone, `module` itself. Its inputs must already be on its device."""
    if world.size == 1:
        return module
    return DistributedDataParallel(module, broadcast_buffers=False)  # its buffers (rope tables) never change


def close_world(world: World) -> None:
    if world.size > 1:
        dist.destroy_process_group()
