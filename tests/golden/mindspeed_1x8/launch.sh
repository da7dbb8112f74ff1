#!/usr/bin/env bash
# parabench 0.1.0 launch bundle: backend=mindspeed model=llama2-7b device=npu nnodes=1 nproc_per_node=8
# Needs parabench installed; reads spec.json from this directory. On node N of a multi-node
# job run it with NODE_RANK=N (and MASTER_ADDR of node 0).
# mindspeed_args.txt: written beside this script for the backend
set -euo pipefail
RUN_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7
export CUDA_DEVICE_MAX_CONNECTIONS=1
export HCCL_ASYNC_ERROR_HANDLING=1
export HCCL_CONNECT_TIMEOUT=1200
export HCCL_EXEC_TIMEOUT=1200
export PYTHONUNBUFFERED=1
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export TASK_QUEUE_ENABLE=2
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
exec torchrun --nnodes=1 --nproc-per-node=8 --max-restarts=0 --master-port=29500 --node-rank="${NODE_RANK:-0}" --master-addr="${MASTER_ADDR:-127.0.0.1}" -m parabench.worker "$RUN_DIR" --tensor-model-parallel-size=8 --pipeline-model-parallel-size=1 --context-parallel-size=1 --micro-batch-size=1 --global-batch-size=64 --seq-length=4096 --num-layers=32 --hidden-size=4096 --ffn-hidden-size=11008 --num-attention-heads=32 --group-query-attention --num-query-groups=32 --normalization=RMSNorm --swiglu --position-embedding-type=rope --disable-bias-linear --untie-embeddings-and-output-weights --transformer-impl=local --distributed-backend=nccl --optimization-level=2 --bf16 --use-distributed-optimizer --use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb --use-flash-attn
