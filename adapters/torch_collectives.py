"""``bench comm`` on torch.distributed: the operations it times and checks, on the device's buffers
(gloo, nccl or hccl). Worker processes only (``parabench.comm.worker`` imports it through
``Stack.ops`` of the ddp adapter's ``comm_stack``); torch is imported when an instance is made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from parabench.adapters.base import WorkerContext
from parabench.collectives import OPS, expected_sum, input_value

# One operation on prepared buffers: (run once, the result to check, the expected result)
Prepared = tuple[Callable[[], None], Callable[[], Any], Callable[[], Any]]


class TorchOps:
    """The operations in torch.distributed; buffers on the device, values from collectives.input_value."""

    DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

    def __init__(self, ctx: WorkerContext, dtype: str):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.dev = ctx.device
        self.dtype = getattr(torch, self.DTYPES[dtype])
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def _values(self, rank, idx):
        return input_value(rank, idx).to(self.dtype)

    def prepare(self, op: str, count: int, inplace: bool, corrupt: bool, filled: bool) -> Prepared:
        torch, dist, n, r = self.torch, self.dist, self.world, self.rank
        dev = self.dev.torch_device
        idx = torch.arange(count, device=dev)
        piece = count // n if OPS[op].split else count
        big = self._values(r, idx) if filled else torch.zeros(count, dtype=self.dtype, device=dev)
        reduce_op = dist.ReduceOp.MAX if corrupt else dist.ReduceOp.SUM  # MAX: the injected wrong reduction
        if op == "all_reduce":
            return (lambda: dist.all_reduce(big, op=reduce_op)), (lambda: big), (lambda: expected_sum(n, idx))
        if op == "broadcast":
            buf = big if r == 0 else torch.zeros_like(big)
            return (lambda: dist.broadcast(buf, src=0)), (lambda: buf), (lambda: self._values(0, idx))
        if op == "all_gather":
            mine = big[r * piece : (r + 1) * piece]
            inp = mine if inplace else mine.clone()
            return (
                (lambda: dist.all_gather_into_tensor(big, inp)),
                (lambda: big),
                (lambda: self._values(idx // piece, idx)),  # rank k sent values(k, i) at global index i
            )
        if op == "reduce_scatter":
            out = big[r * piece : (r + 1) * piece] if inplace else torch.empty(piece, dtype=self.dtype, device=dev)
            mine = idx[r * piece : (r + 1) * piece]
            return (
                (lambda: dist.reduce_scatter_tensor(out, big, op=reduce_op)),
                (lambda: out),
                (lambda: expected_sum(n, mine)),
            )
        out = torch.zeros_like(big)
        if op == "all_to_all":  # chunk j of rank i lands in chunk i of rank j
            return (
                (lambda: dist.all_to_all_single(out, big)),
                (lambda: out),
                (lambda: self._values(idx // piece, r * piece + idx % piece)),
            )

        def ring() -> None:  # send_recv: to the next rank, from the previous one (nccl-tests sendrecv)
            ops = [dist.P2POp(dist.isend, big, (r + 1) % n), dist.P2POp(dist.irecv, out, (r - 1) % n)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return ring, (lambda: out), (lambda: self._values((r - 1) % n, idx))

    def wrong(self, got, expected) -> int:
        return int((got.float() != expected.float()).sum())

    def corrupt_result(self, got) -> None:
        got.view(-1)[0] += 1

    def barrier(self) -> None:
        self.dist.barrier()
