"""Tensor parallelism for FLUX: process-group setup, in-place sharding of a loaded transformer into column/row-parallel
`model.linear.Linear` layers, cross-rank all-or-nothing GELU mounting, and the per-rank worker (`tp.worker.TPWorker`)."""

from .dist import default_backend, find_free_port, init_tp, shutdown_tp
from .shard import TPInfo, check_replicas_identical, gather_full_state_dict, mount_all_ranks, shard_transformer, tp_info

__all__ = [
    "TPInfo",
    "TPWorker",
    "check_replicas_identical",
    "default_backend",
    "find_free_port",
    "gather_full_state_dict",
    "init_tp",
    "mount_all_ranks",
    "shard_transformer",
    "shutdown_tp",
    "tp_info",
]


def __getattr__(name: str):
    # The worker pulls in the pipeline (diffusers, transformers): import it only when asked for.
    if name == "TPWorker":
        from .worker import TPWorker

        return TPWorker
    raise AttributeError(name)
