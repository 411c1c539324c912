"""The torch.distributed world of a ranked executor (the trainer, the critic): its device, its process group, its
FSDP2 sharding, and the collective methods rank 0 runs on every rank.

Rank 0 decides (the controller in the trainer, the gRPC service in the critic); every rank executes the same method
at the same time, because training, checkpoint gathering and weight pushes are collective. Call sites name the method
(`trainer.train(rollouts, step)`); rank 0's call broadcasts it to the followers.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

# Long enough for rank 0 to wait out a slow generation batch between two collective calls.
DIST_TIMEOUT = timedelta(minutes=30)

F = TypeVar("F", bound=Callable[..., Any])
_COLLECTIVE: set[Callable[..., Any]] = set()
"""The methods `collective` made: the only ones a follower runs."""
Timing = Mapping[Callable[..., Any], Callable[[], AbstractContextManager[Any]]]
"""By collective method, the state (a clock's busy or idle) a follower runs it in."""


def rank_device(gpus: int, environ: Mapping[str, str]) -> torch.device:
    """The GPU of this process among its pod's (LOCAL_RANK, as torchrun sets it; 0 when absent), or the CPU."""
    return torch.device("cuda", int(environ.get("LOCAL_RANK", 0))) if gpus else torch.device("cpu")


def init_world(device: torch.device, rank: int, world_size: int, key: str) -> None:
    """NCCL on GPUs, gloo on CPUs (MASTER_ADDR/PORT from the environment); NCCL's object broadcasts use the
    current device, so set it first. The rendezvous keys live under `key` (auth.sync_key of the job's token), as a
    weight-sync group's do: a process without the token cannot take a rank in the store rank 0 hosts."""
    if not key:
        raise ValueError("a ranked world needs the job's sync key (auth.sync_key of its token)")
    # As torch's env:// rendezvous builds it, keyed.
    store = dist.PrefixStore(f"{key}/world/", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=rank == 0,
        timeout=DIST_TIMEOUT, multi_tenant=True))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, timeout=DIST_TIMEOUT,
                                device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=DIST_TIMEOUT)


def shard(model: nn.Module, layers: Iterable[nn.Module], compute_dtype: torch.dtype | None = None,
          keep_gathered: bool = False, mesh: Any = None) -> None:
    """FSDP2: each decoder layer is its own unit (gathered only while it runs), then the rest.

    With `compute_dtype`, the shards stay in their own dtype (float32 master weights, so the optimizer's state is
    float32 too) and each unit gathers a copy in `compute_dtype` to run its forward and backward with; gradients
    are reduced and accumulated in float32. A unit's forward inputs are not cast: they come out of the units before
    it already in `compute_dtype` (casting them walked every argument of every layer's forward on the host, a
    millisecond a layer). `keep_gathered`: a unit stays gathered from its forward to its
    backward instead of being gathered again (on one rank there is nothing to free: the shard is the whole).
    `mesh`: the device mesh to shard over (a pipeline stage's ranks); None: the whole world."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype and torch.float32,
                                  cast_forward_inputs=False)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=not keep_gathered)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=not keep_gathered)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter or gradient (FSDP2's are DTensors), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def collective(method: F) -> F:
    """A method every rank of the world runs together (training, checkpoint gathering and weight pushes are
    collective). Called on rank 0 of a world of several, it first broadcasts its name and arguments, and each
    follower (in `follow_rank0`) runs the same method with them; elsewhere it just runs. Its object has `rank` and
    `world_size`; it calls no other collective method (a follower would run that one twice)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.rank == 0 and self.world_size > 1:
            dist.broadcast_object_list([(method.__name__, args, kwargs)], src=0)
        return method(self, *args, **kwargs)

    _COLLECTIVE.add(call)
    return cast(F, call)


def follow_rank0(member: Any, timing: Timing | None = None) -> None:
    """Ranks > 0: run rank 0's collective calls on `member` until rank 0 stops them (`release_followers`);
    `timing` names the state each method runs in there. A broadcast naming a method that is not
    collective is refused: a follower runs nothing else."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        name, args, kwargs = box[0]
        method = getattr(type(member), name, None)
        if not callable(method) or method not in _COLLECTIVE:
            raise RuntimeError(f"rank 0 asked rank {member.rank} to run {type(member).__name__}.{name}, which is not "
                               f"a collective method (workers.world.collective): refused")
        with (timing or {}).get(method, nullcontext)():
            method(member, *args, **kwargs)


def release_followers(rank: int, world_size: int) -> None:
    """Rank 0: end the followers' `follow_rank0`."""
    if rank == 0 and world_size > 1:
        dist.broadcast_object_list([None], src=0)
