"""The tensor-parallel group and its collectives: the lowest layer of the runtime.

`models/` calls the collectives in its forward passes; `worker/` joins the group once
per process (`init_distributed_environment`) and marks its waits for the device
(`device_sync_point`). Nothing here imports any other package of the project.
"""

from distributed.communication_op import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from distributed.parallel_state import (
    TensorParallelGroup,
    destroy_distributed_environment,
    device_sync_point,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    set_tensor_parallel_group,
    tp_collective_timeout,
)
from distributed.utils import divide, kv_heads_per_rank

__all__ = [
    "TensorParallelGroup",
    "destroy_distributed_environment",
    "device_sync_point",
    "divide",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed_environment",
    "kv_heads_per_rank",
    "set_tensor_parallel_group",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tp_collective_timeout",
]
