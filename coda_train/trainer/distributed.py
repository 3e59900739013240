"""Data parallelism under torchrun (trainer.parallel: DDP, or FSDP2 sharding parameters, gradients and
optimizer state); a plain `python train.py` is world size 1 and touches none of it. Multi-GPU runs
export NCCL_NVLS_ENABLE=0 (NVLink SHARP multicast off; README, Multi-GPU)."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from coda_train.errors import ConfigError

log = logging.getLogger(__name__)

PARALLEL = ("auto", "none", "ddp", "fsdp")  # auto: none for one process, fsdp under torchrun


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # host-side collectives (the stop check) over gloo, so they never wait for the GPU; None: the default group
    control_group: Optional[Any] = field(default=None, compare=False, repr=False)

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
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return World(rank, world_size, local_rank, control)


def process_device(device: torch.device, world: World) -> torch.device:
    """This process's device: its own GPU (torchrun's LOCAL_RANK) when data-parallel on cuda."""
    if world.distributed and device.type == "cuda":
        return torch.device("cuda", world.local_rank)
    return device


def resolve_parallel(name: str, world: World) -> str:
    """trainer.parallel for this world: none | ddp | fsdp. ddp or fsdp asked of one process runs as none, said and
    not refused (as check_fsdp_options does), so one config serves a run on one GPU and on several."""
    if name == "auto":
        return "fsdp" if world.distributed else "none"
    if name != "none" and not world.distributed:  # one process has nothing to average or shard
        log.warning("trainer.parallel=%s needs several processes, and this run is one (launched without torchrun, or "
                    "with --nproc_per_node=1): it trains as trainer.parallel=none on one device. To train "
                    "data-parallel, launch one process per GPU: NCCL_NVLS_ENABLE=0 torchrun --standalone "
                    "--nproc_per_node=N train.py ...", name)
        return "none"
    if name == "none" and world.distributed:
        raise ConfigError(f"trainer.parallel=none cannot run {world.world_size} processes (each would train alone); "
                          "use trainer.parallel=fsdp or ddp, or launch one process")
    return name


def check_fsdp_options(parallel: str, reshard_after_forward: bool) -> None:
    """trainer.fsdp_* keys act under FSDP2 only; under DDP they would be silently ignored. One process shards
    nothing: said, not refused, so one config serves a run on one GPU and on several."""
    if reshard_after_forward and parallel == "ddp":
        raise ConfigError("trainer.fsdp_reshard_after_forward=true applies to FSDP2 only, and this run uses "
                          "trainer.parallel=ddp: set trainer.parallel=fsdp, or trainer.fsdp_reshard_after_forward=false")
    if reshard_after_forward and parallel == "none":
        log.warning("trainer.fsdp_reshard_after_forward=true has no effect in a run of one process (nothing is "
                    "sharded); it applies under torchrun with several processes and trainer.parallel=fsdp")


def shard_model(model: nn.Module, compute_dtype: torch.dtype, reshard_after_forward: bool = False) -> None:
    """FSDP2 in place, before the optimizer is built (it then holds the sharded DTensor parameters):
    one unit per block (LayerWeights), the root unit holding the embedding, final norm and LM head.
    Each block runs inside its unit's call, so the unit's hooks gather it for the block's forward
    and, on the block's input gradient, reduce-scatter its gradients while the previous block's
    backward runs. The forward prefetches two units ahead: a CODA block also reads the next block's
    attn_norm, so unit l+1 is gathered before block l runs and unit l+2's all-gather overlaps block l
    (docs/design.md, FSDP2 and the CODA Functions). reshard_after_forward frees each block's gathered
    weights after its forward and gathers them again (prefetched one unit ahead) for its backward;
    otherwise they stay until its backward ends. In bf16 the gathered weights are bf16 (the compute
    copies), the fp32 masters stay sharded and gradients are reduced in fp32; otherwise the policy
    changes nothing. Inputs are never cast: the row scales and RoPE tables stay fp32."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype if compute_dtype != torch.float32 else None,
                                  reduce_dtype=torch.float32, cast_forward_inputs=False)
    layers = list(model.layers)
    for layer in layers:
        fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)  # the LM head's backward comes first
    model.set_modules_to_forward_prefetch(layers[:2])
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 3])


def data_parallel(model: nn.Module, parallel: str, device: torch.device) -> nn.Module:
    """What the step calls forward on: a DDP wrapper (it averages gradients across ranks during
    backward; the wrapper only runs forward), or the model itself (unwrapped, or sharded in place)."""
    if parallel != "ddp":
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


@contextlib.contextmanager
def gradient_sync(forward: nn.Module, sync: bool):
    """Inside, a backward averages gradients across ranks only if sync: accumulation micro-batches
    other than the last skip the communication (DDP no_sync, FSDP2 set_requires_gradient_sync)."""
    if sync:
        yield
    elif isinstance(forward, DistributedDataParallel):
        with forward.no_sync():
            yield
    elif isinstance(forward, FSDPModule):
        forward.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            forward.set_requires_gradient_sync(True)
    else:
        yield


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together; for sharded (DTensor) gradients the norm over every rank's shards."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def close_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()  # every group, the control group included


def mean_over_ranks(value: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG if value.is_cuda else dist.ReduceOp.SUM)
        if not value.is_cuda:  # gloo has no AVG
            value /= world.world_size
    return value


def any_rank(flag: bool, world: World) -> bool:
    """True on every rank if it is true on one (so all ranks stop at the same step). A host-side
    collective (a CPU tensor over world.control_group): it syncs the processes, not their GPUs, so the
    loop calling it every step still runs ahead of the GPU."""
    if not world.distributed:
        return flag
    t = torch.tensor(float(flag))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.control_group)
    return bool(t.item())


def refused_on_any_rank(check: Callable[[], None], world: World) -> None:
    """Run a per-rank check that raises ConfigError (each rank's own GPU, e.g. its free memory) so that every rank
    stops when one refuses: a rank stopping alone would leave the others waiting in their next collective until its
    timeout. A refusing rank raises its own error, the others the first refusing rank's, named. Host-side, over
    world.control_group."""
    if not world.distributed:
        check()
        return
    mine: Optional[ConfigError] = None
    try:
        check()
    except ConfigError as e:
        mine = e
    said: list[Optional[str]] = [None] * world.world_size
    dist.all_gather_object(said, None if mine is None else str(mine), group=world.control_group)
    if mine is not None:
        raise mine
    first = next(((rank, text) for rank, text in enumerate(said) if text is not None), None)
    if first is not None:
        raise ConfigError(f"rank {first[0]} refused the run: {first[1]}")


def from_main(obj: Any, world: World) -> Any:
    """Rank 0's value of obj on every rank (e.g. the run dir, which hydra times per process)."""
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def raise_from_main(error: Optional[BaseException], world: World) -> None:
    """Raise rank 0's error (None: there is none) on every rank, so that all stop together: a rank stopping alone would
    leave the others waiting for it in their next collective."""
    error = from_main(error, world)
    if error is not None:
        raise error


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()
