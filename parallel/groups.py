"""Joining the ranks of one replica: torch.distributed, yunchang's groups, a device mesh."""

from __future__ import annotations

import datetime
import socket

from parallel.config import ParallelConfig


def free_port(host: str = "") -> int:
    """A TCP port free on this node, for the rendezvous chosen by rank 0."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join(rank: int, config: ParallelConfig, master_addr: str, master_port: int, device: str,
         timeout_s: float = 300.0):
    """Join the replica's process group (NCCL on CUDA, gloo on CPU), set yunchang's
    Ulysses/ring groups (one set per CFG group: yunchang's data-parallel groups) and return the
    ``(cfg, ring, ulysses)`` DeviceMesh (diffusers' sharding hooks read its ``ring`` and
    ``ulysses`` dimensions, CFG parallelism its ``cfg`` one). Blocks until all ``world_size``
    ranks have joined (raises after ``timeout_s``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from yunchang import set_seq_parallel_pg

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=config.world_size, timeout=datetime.timedelta(seconds=timeout_s))
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    set_seq_parallel_pg(config.ulysses_degree, config.ring_degree, rank, config.world_size)
    device_type = "cuda" if backend == "nccl" else "cpu"
    return init_device_mesh(device_type, (config.cfg_degree, config.ring_degree, config.ulysses_degree),
                            mesh_dim_names=("cfg", "ring", "ulysses"))


def agree_at_boundary(stop: bool, gone: set[int], batch_size: int) -> tuple[bool, set[int]]:
    """What every rank of the replica does at a step boundary: stop the batch if any rank
    wants to, and drop the rows of every request (batch index) any rank knows is gone. One
    all-reduce (max) of ``1 + batch_size`` flags over the replica's process group, called by
    every rank at the same step boundary, so all ranks stop (or drop the same rows) together (a
    rank that stopped alone would leave the others blocked in the next collective)."""
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flags = torch.zeros(1 + batch_size, dtype=torch.int32)
    flags[0] = int(stop)
    for i in gone:
        flags[1 + i] = 1
    flags = flags.to(device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    flags = flags.cpu()
    return bool(flags[0]), {i for i in range(batch_size) if flags[1 + i]}


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank of the replica's process group (pickled; every rank
    calls it at the same point, the others passing None). Tensors inside should be on the
    host: each rank moves them to its own device."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def leave() -> None:
    """Destroy the replica's process group, if this process joined one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
