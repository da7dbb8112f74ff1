#!/bin/bash
# Single-node launch on 8 GPUs.
set -euo pipefail

export ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7
export CUDA_DEVICE_MAX_CONNECTIONS=1
# [bench migrate] dropped, no HCCL equivalent: export NCCL_IB_DISABLE=1
export HCCL_SOCKET_IFNAME=eth0
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True

NGPUS=$(nvidia-smi -L | wc -l)
torchrun --nproc_per_node "$NGPUS" train.py --backend hccl --device npu
