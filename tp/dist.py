"""Process-group setup for tensor parallelism.

One process per rank; rendezvous over `tcp://master_addr:port` (rank 0 hosts the store). The timeout bounds both
the rendezvous (a rank that never arrives makes the others raise instead of waiting forever) and, on gloo, every
collective (a rank that dies mid-step makes the survivors raise). On NCCL the same timeout arms the watchdog,
which aborts the communicator and the process: an actor-level failure the caller sees as a dead actor.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29517
DEFAULT_TIMEOUT_S = 120.0
BACKENDS = ("nccl", "gloo")


def default_backend(device: str | torch.device) -> str:
    """NCCL for ranks on CUDA devices (one GPU per rank), gloo on the CPU (`resolve_backend` with no choice)."""
    return resolve_backend(None, device)


def resolve_backend(backend: str | None, device: str | torch.device, ranks_share_gpu: bool = False) -> str:
    """The one backend rule. None: NCCL on CUDA, gloo on the CPU. Ranks that share a GPU (fractional GPUs per rank)
    need gloo, which carries CUDA tensors through host memory: NCCL cannot put two ranks on one device. That mode
    is for testing the sharded GPU kernels on one GPU, not for speed. ValueError for a combination that cannot run."""
    cuda = torch.device(device).type == "cuda"
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (or unset), got {backend!r}")
    if ranks_share_gpu and cuda and backend != "gloo":
        raise ValueError("ranks that share a GPU need backend: gloo (NCCL cannot put two ranks on one device); "
                         "that mode is for testing, give each rank a whole GPU for speed")
    if backend == "nccl" and not cuda:
        raise ValueError(f"backend nccl needs device cuda, got {str(device)!r}")
    return backend or ("nccl" if cuda else "gloo")


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (rank 0's host picks it and hands it to the other ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_tp(
    rank: int,
    world_size: int,
    backend: str | None = None,
    master_addr: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device: torch.device | str | None = None,
) -> dist.ProcessGroup:
    """Join the tensor-parallel group as `rank` of `world_size` and return it (the default/world group).

    backend: None -> `default_backend(device)` (gloo without a device). device: the CUDA device this rank computes
    on (NCCL only; binds the communicator to it eagerly so a bad rendezvous fails here, not at the first collective).
    Raises (torch's DistStoreError / RuntimeError) if the other ranks do not join within `timeout_s`.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists in this process; call shutdown_tp() first")
    backend = resolve_backend(backend, device if device is not None else "cpu")
    if backend == "gloo" and device is not None and torch.device(device).type == "cuda":
        logger.warning("TP rank %d of %d: gloo on CUDA tensors (ranks sharing a GPU): for testing only, every "
                       "all-reduce goes through host memory", rank, world_size)
    kwargs = {}
    if backend == "nccl" and device is not None:
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    return dist.group.WORLD


def shutdown_tp() -> None:
    """Leave the group (no-op when none was initialised)."""
    if dist.is_initialized():
        dist.destroy_process_group()
