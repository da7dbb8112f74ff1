"""Per-rank entry of ``bench comm``: ``python -m parabench.comm.worker RUN_DIR`` (started by the
backend's launcher, torchrun or msrun, like :mod:`parabench.worker`).

Reads ``comm.json``, joins the world through the backend's adapter (torch.distributed on gloo, nccl
or hccl; MindSpore on mccl or hccl), and for every (operation, size) of the sweep: runs the warm-up
iterations, then times ``iters`` operations between device synchronisations (this rank's mean time
per operation), then, with the check on, fills the inputs with known values, runs the operation
once more and counts the result elements that differ from the expected values (nccl-tests -c).
Timed iterations run on zero-filled buffers, so that repeated in-place sums cannot overflow.
Writes ``ranks/rank<R>.json``; the front end (:mod:`parabench.comm.command`) takes the slowest rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from parabench.adapters.base import WorkerContext
from parabench.adapters.registry import get_adapter
from parabench.collectives import OPS, CommJob, expected_sum, input_value, options, stack_for
from parabench.devices import DEVICES
from parabench.errors import SpecError
from parabench.launchers import msrun_scheduler_started, rank_of, serve_msrun_scheduler
from parabench.loop import write_json_atomic
from parabench.spec import BackendSpec, DeviceSpec, LaunchSpec, TrackingSpec, build

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


class MindSporeOps:
    """all_reduce, all_gather and broadcast through MindSpore's communication operators (what its
    CPU backend mccl implements; collectives.STACKS lists the refusals)."""

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


OPS_CLASSES: dict[str, type[TorchOps] | type[MindSporeOps]] = {"ddp": TorchOps, "mindspore": MindSporeOps}


def measure(ops, spec: dict[str, Any], sync: Callable[[], None]) -> list[dict[str, Any]]:
    opts, rows = spec["config"]["comm"], []
    for point in spec["points"]:
        op, count = point["op"], point["count"]
        corrupt = opts["corrupt"] == op
        run, _, _ = ops.prepare(op, count, opts["inplace"], corrupt, filled=False)
        for _ in range(opts["warmup_iters"]):
            run()
        ops.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(opts["iters"]):
            run()
        sync()
        seconds = (time.perf_counter() - t0) / opts["iters"]
        wrong = None
        if opts["check"]:
            run, got, want = ops.prepare(op, count, opts["inplace"], corrupt, filled=True)
            run()
            sync()
            if corrupt and not OPS[op].reduces and ops.rank == 0:
                ops.corrupt_result(got())  # a non-reducing op has no wrong reduction: flip one element
            wrong = ops.wrong(got(), want())
        rows.append({**point, "time_s": seconds, "wrong": wrong})
    return rows


def comm_job(plain: Mapping[str, Any]) -> CommJob:
    """The CommJob of a composed ``bench comm`` config (plain dict; ``comm.json`` holds the same)."""
    backend_node = dict(plain.get("backend") or {})
    name = backend_node.pop("name", None) or "ddp"
    stack_for(name)  # refuses a backend bench comm does not drive
    adapter = get_adapter(name)
    extra = sorted(set(plain) - {"backend", "device", "launcher", "tracking", "comm", "run"})
    if extra:
        raise SpecError(extra[0], "unknown top-level key of bench comm")
    job = CommJob(
        backend=BackendSpec(name, build(adapter.Options, backend_node, "backend"), adapter),
        device=build(DeviceSpec, plain.get("device"), "device"),
        launch=build(LaunchSpec, plain.get("launcher"), "launcher"),
        tracking=build(TrackingSpec, plain.get("tracking"), "tracking"),
        results_dir=str((plain.get("run") or {}).get("results_dir", "results")),
        options=options(plain.get("comm")),
    )
    for key, value in [("launcher.nnodes", job.launch.nnodes), ("launcher.nproc_per_node", job.launch.nproc_per_node)]:
        if value <= 0:
            raise SpecError(key, f"must be > 0, got {value}")
    return job


def main(argv: list[str] | None = None) -> int:
    if msrun_scheduler_started():
        return serve_msrun_scheduler()
    run_dir = Path((sys.argv[1:] if argv is None else argv)[0])
    spec = json.loads((run_dir / "comm.json").read_text())
    job = comm_job(spec["config"])
    adapter = job.backend.adapter
    rank, local_rank, world = rank_of(job, run_dir)
    print(f"[parabench comm] rank {rank}/{world} pid {os.getpid()}", flush=True)
    try:
        ctx = WorkerContext(job, rank, world, local_rank, DEVICES[spec["device"]](local_rank), run_dir)  # type: ignore[arg-type]
        comm = adapter.init_worker(ctx)
        ops = OPS_CLASSES[job.backend.name](ctx, job.options.dtype)
        rows = measure(ops, spec, ctx.device.synchronize)
        (run_dir / "ranks").mkdir(exist_ok=True)
        write_json_atomic(run_dir / "ranks" / f"rank{rank}.json", {"rank": rank, "rows": rows})
        comm.close()
        return 0
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
