"""nanoGPT-style training script (GPU version). Runs on 'cuda' by default."""
import os
import time
import argparse

import torch
import torch_npu
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig
from utils.dist_utils import setup_distributed, is_main

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="npu", help="cuda, cuda:N or cpu")
parser.add_argument("--backend", default="hccl")
parser.add_argument("--compile", action="store_true")
parser.add_argument("--no_cuda", action="store_true")
args = parser.parse_args()

os.environ.setdefault("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True")
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    local_rank = setup_distributed(args.backend)
    device = f"npu:{local_rank}"
    torch.npu.set_device(device)
else:
    device = args.device
device_type = "npu" if "npu" in device else "cpu"
dtype = "bfloat16" if torch.npu.is_available() and torch.npu.is_bf16_supported() else "float16"
ctx = torch.amp.autocast(device_type=device_type, dtype=getattr(torch, dtype))
scaler = torch.npu.amp.GradScaler(enabled=(dtype == "float16"))

torch.manual_seed(1337)
torch.npu.manual_seed(1337)
torch.npu.matmul.allow_hf32 = True  # allow tf32 on matmul
torch.npu.conv.allow_hf32 = True

model = GPT(GPTConfig()).to(device)
if args.compile:
    model = torch.compile(model)
if ddp:
    model = DDP(model, device_ids=[local_rank])

optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, device_type=device_type)
x = torch.randint(0, 50304, (8, 256)).pin_memory().to(device, non_blocking=True)
for it in range(10):
    t0 = time.time()
    with ctx:
        logits, loss = model(x, x)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    torch.npu.synchronize()
    if is_main():
        # report peak memory on the GPU
        print(f"iter {it}: loss {loss.item():.4f}, {torch.npu.max_memory_allocated() / 2**30:.2f} GiB")

if ddp:
    dist.destroy_process_group()
