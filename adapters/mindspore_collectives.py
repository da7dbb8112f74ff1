"""``bench comm`` on MindSpore: all_reduce, all_gather and broadcast through its communication
operators (mccl on CPU, hccl on Ascend). Worker processes only (``parabench.comm.worker`` imports it
through ``Stack.ops`` of the mindspore adapter's ``comm_stack``); MindSpore is imported when an
instance is made."""

from __future__ import annotations

from typing import Any

from parabench.adapters.base import WorkerContext
from parabench.adapters.torch_collectives import Prepared
from parabench.collectives import OPS, expected_sum, input_value


class MindSporeOps:
    """all_reduce, all_gather and broadcast through MindSpore's communication operators (what its
    CPU backend mccl implements; the mindspore adapter's comm_stack lists the refusals)."""

    DTYPES = {"fp32": "float32", "fp16": "float16"}

    def __init__(self, ctx: WorkerContext, dtype: str):
        del ctx  # MindSpore's communication is initialised by the adapter's init_worker
        import mindspore as ms
        import numpy as np
        from mindspore import communication, ops

        self.ms, self.np, self.msops = ms, np, ops
        self.dtype = getattr(np, self.DTYPES[dtype])
        self.rank, self.world = communication.get_rank(), communication.get_group_size()
        self._sum = ops.AllReduce(ops.ReduceOp.SUM)

    def prepare(self, op: str, count: int, inplace: bool, corrupt: bool, filled: bool) -> Prepared:
        np, ms, n, r = self.np, self.ms, self.world, self.rank
        idx = np.arange(count)
        piece = count // n if OPS[op].split else count
        data = input_value(r, idx).astype(self.dtype) if filled else np.zeros(count, self.dtype)
        result: dict[str, Any] = {}
        if op == "all_reduce":
            if corrupt and filled and r == 0:
                # the injected wrong reduction: MindSpore's CPU AllReduce reduces with SUM only
                # (allreduce_cpu_kernel.cc: "AllReduce only support reduce sum on CPU"), so rank 0
                # adds a wrong contribution instead of TorchOps' MAX: every rank's sum is off by one
                data = data + 1
            tensor, prim, want = ms.Tensor(data), self._sum, (lambda: expected_sum(n, idx))
        elif op == "all_gather":
            tensor, prim = ms.Tensor(data[r * piece : (r + 1) * piece]), self.msops.AllGather()
            want = lambda: input_value(idx // piece, idx)  # noqa: E731  (rank k sent values(k, i) at index i)
        else:  # broadcast
            tensor = ms.Tensor(data if r == 0 else np.zeros(count, self.dtype))
            bcast = self.msops.Broadcast(0)
            prim, want = (lambda t: bcast((t,))[0]), (lambda: input_value(0, idx))

        def run() -> None:
            result["out"] = prim(tensor).asnumpy()  # asnumpy waits for the operation

        return run, (lambda: result["out"]), want

    def wrong(self, got, expected) -> int:
        return int((got.astype("float64") != expected.astype("float64")).sum())

    def corrupt_result(self, got) -> None:
        got.reshape(-1)[0] += 1

    def barrier(self) -> None:
        self._sum(self.ms.Tensor(self.np.zeros(1, self.np.float32))).asnumpy()
