"""Data parallelism under torchrun (DDP); a plain `python train.py` is world size 1 and touches none of it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes the run dir: config, metrics, checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_world(device_type: str) -> World:
    """The process group torchrun describes in the environment (NCCL on GPUs, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return World()
    world = World(int(os.environ["RANK"]), world_size, int(os.environ["LOCAL_RANK"]))
    if device_type == "cuda":
        torch.cuda.set_device(world.local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return world


def process_device(device: torch.device, world: World) -> torch.device:
    """This process's device: its own GPU (torchrun's LOCAL_RANK) when data-parallel on cuda."""
    if world.distributed and device.type == "cuda":
        return torch.device("cuda", world.local_rank)
    return device


def data_parallel(model: nn.Module, device: torch.device, world: World) -> nn.Module:
    """What the step calls forward on: under torchrun a DDP wrapper, which averages gradients across
    ranks during backward (its wrapper only runs forward); the model itself otherwise."""
    if not world.distributed:
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def close_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def mean_over_ranks(value: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG if value.is_cuda else dist.ReduceOp.SUM)
        if not value.is_cuda:  # gloo has no AVG
            value /= world.world_size
    return value


def any_rank(flag: bool, world: World, device: torch.device) -> bool:
    """True on every rank if it is true on one (so all ranks stop at the same step)."""
    if not world.distributed:
        return flag
    t = torch.tensor(float(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def from_main(obj: Any, world: World) -> Any:
    """Rank 0's value of obj on every rank (e.g. the run dir, which hydra times per process)."""
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()
