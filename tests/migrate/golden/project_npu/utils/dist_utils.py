import datetime
import os

import torch
import torch_npu
import torch.distributed as dist
from torch import cuda


def setup_distributed(backend="hccl"):
    """Initialise NCCL and pin this rank's GPU."""
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.npu.set_device(local_rank)
    if dist.get_backend() == "nccl":
        os.environ["HCCL_ASYNC_ERROR_HANDLING"] = "1"
    return local_rank


def is_main():
    return not dist.is_initialized() or dist.get_rank() == 0


def gpu_supports_bf16():
    return cuda.get_device_capability()[0] >= 8
