"""parabench.redirect: scoped cuda/npu -> cpu redirection, and nothing left behind."""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.overrides import _get_current_function_mode_stack

from parabench import redirect as rt
from parabench.redirect import RedirectError, install, redirect


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _snapshot() -> dict:
    """Everything a redirection may touch, by identity."""
    import torch.distributed.distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel as DDP

    owners = {
        "torch": torch, "torch.cuda": torch.cuda, "torch.cuda.random": torch.cuda.random,
        "torch.cuda.memory": torch.cuda.memory, "torch.cuda.nvtx": torch.cuda.nvtx, "Tensor": torch.Tensor,
        "Module": nn.Module, "autocast": torch.amp.autocast_mode.autocast,
        "GradScaler": torch.amp.grad_scaler.GradScaler, "DDP": DDP, "dist": dist, "c10d": c10d,
        "serialization": torch.serialization, "DeviceContext": torch.utils._device.DeviceContext,
    }  # fmt: skip
    snap = {k: {n: id(v) for n, v in vars(o).items()} for k, o in owners.items()}
    snap["sys.modules"] = {n: id(m) for n, m in sys.modules.items()}
    snap["meta_path"] = [id(f) for f in sys.meta_path]
    snap["copyreg"] = dict(copyreg.dispatch_table)
    snap["modes"] = [id(m) for m in _get_current_function_mode_stack()]
    snap["stack"] = list(rt._STACK)
    return snap


def _exercise_cuda() -> None:
    x = torch.ones(2, device="cuda").cuda()
    nn.Linear(2, 2).cuda()(x)
    with torch.autocast("cuda"):
        torch.mm(x[None], x[:, None])
    torch.cuda.amp.GradScaler()
    torch.cuda.manual_seed(0)


def _exercise_npu() -> None:
    import torch_npu  # noqa: F401
    from torch_npu.contrib import transfer_to_npu  # noqa: F401  (nests cuda -> cpu)

    x = torch.ones(2, device="npu:0").npu()
    nn.Linear(2, 2).npu()(x)
    torch.device("npu:0")
    torch.ones(1).cuda()


@pytest.mark.parametrize(("source", "exercise"), [("cuda", _exercise_cuda), ("npu", _exercise_npu)])
def test_no_patch_left_behind(source, exercise):
    with redirect(source, "cpu"):  # warm up lazy torch imports so the snapshot is stable
        exercise()
    before = _snapshot()
    handle = install(source, "cpu")
    exercise()
    assert len(handle.patched) > 20
    assert _snapshot() != before
    handle.remove()
    handle.remove()  # idempotent
    after = _snapshot()
    assert after == before
    assert not torch.cuda.is_available()
    assert not hasattr(torch, "npu") and "torch_npu" not in sys.modules
    assert rt.current() is None


def test_import_is_cheap_and_patches_nothing():
    code = "import sys, parabench.redirect; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("dev", ["cuda", "cuda:0", torch.device("cuda", 0), torch.device("cuda"), 0])
def test_factory_functions(dev):
    with redirect():
        made = [
            torch.zeros(2, device=dev), torch.ones(2, device=dev), torch.empty(2, device=dev),
            torch.full((2,), 1.0, device=dev), torch.rand(2, device=dev), torch.randn(2, device=dev),
            torch.randint(0, 5, (2,), device=dev), torch.arange(3, device=dev), torch.linspace(0, 1, 3, device=dev),
            torch.eye(2, device=dev), torch.tensor([1.0], device=dev), torch.as_tensor([1.0], device=dev),
            torch.zeros_like(torch.ones(2), device=dev), torch.ones(2).new_zeros(3, device=dev),
            torch.ones(2).new_tensor([1], device=dev), torch.empty_strided((2,), (1,), device=dev),
            torch.ones(2).to(dev), torch.ones(2).to(dev, torch.float16), torch.ones(2).to(device=dev),
            torch.tensor([1], device=dev, pin_memory=True), torch.ones(1).pin_memory(),
        ]  # fmt: skip
        with torch.device("cuda"):
            made.append(torch.empty(1))
        torch.set_default_device(dev)
        try:
            made.append(torch.empty(1))
        finally:
            torch.set_default_device(None)
        assert {t.device.type for t in made} == {"cpu"}


def test_tensor_and_module_methods():
    with redirect():
        t = torch.ones(2).cuda()
        assert t.device.type == "cpu" and torch.ones(1).cuda(0).device.type == "cpu"
        assert t.is_cuda
        assert t.type() == "torch.cuda.FloatTensor"  # Megatron's optimizers compare these strings
        assert t.type("torch.cuda.HalfTensor").dtype == torch.float16
        assert isinstance(t, torch.cuda.FloatTensor)
        m = nn.Linear(2, 2).cuda()
        m.to("cuda:0")
        m.to(torch.device("cuda"), torch.float64)
        assert m.weight.device.type == "cpu" and m.weight.dtype == torch.float64
        t.record_stream(torch.cuda.current_stream())
        print(repr(t))  # printing must not trip over the patched type()
    assert not torch.ones(1).is_cuda and torch.ones(1).type() == "torch.FloatTensor"


def test_runtime_queries(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with redirect() as h:
        assert h.emulated and torch.cuda.EMULATED and rt.current("cuda") is h
        assert torch.cuda.is_available() and torch.cuda.is_initialized()
        assert torch.cuda.device_count() == 2
        torch.cuda.set_device(1)
        assert torch.cuda.current_device() == 1
        with torch.cuda.device(0):
            assert torch.cuda.current_device() == 0
        assert torch.cuda.current_device() == 1
        torch.cuda.set_device("cuda:0")
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            pass
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record()
        assert start.elapsed_time(end) >= 0 and end.query()
        assert torch.cuda.memory_allocated() == 0 and torch.cuda.max_memory_reserved() == 0
        assert torch.cuda.memory_stats()["allocated_bytes.all.peak"] == 0
        free, total = torch.cuda.mem_get_info()
        assert 0 < free <= total
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.is_bf16_supported()
        assert torch.cuda.get_device_capability() == (0, 0)
        assert "emulated cuda" in torch.cuda.get_device_name(0)
        assert torch.cuda.get_device_properties(0).total_memory == total
        torch.cuda.nvtx.range_push("x")
        torch.cuda.nvtx.range_pop()
        calls = []
        torch.cuda._lazy_call(lambda: calls.append(1))  # Megatron binds _lazy_call at import
        assert calls == [1]


def test_rng_state():
    with redirect():
        torch.cuda.manual_seed(7)
        a = torch.randn(3, device="cuda")
        torch.manual_seed(7)
        assert torch.equal(a, torch.randn(3))
        state = torch.cuda.get_rng_state()
        r1 = torch.rand(2, device="cuda")
        torch.cuda.set_rng_state(state)
        assert torch.equal(r1, torch.rand(2, device="cuda"))
        torch.cuda.random.set_rng_state(state)  # Megatron calls the torch.cuda.random names
        assert torch.equal(r1, torch.rand(2))
        assert torch.cuda.default_generators[0] is torch.default_generator
        states = torch.cuda.get_rng_state_all()
        torch.cuda.manual_seed_all(1)
        torch.cuda.set_rng_state_all(states)
        assert torch.equal(torch.cuda.get_rng_state(), states[0])
        assert torch.cuda.initial_seed() == torch.initial_seed()


def test_autocast_and_grad_scaler():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with redirect():
        with torch.autocast(device_type="cuda"):
            assert lin(x).dtype == torch.bfloat16
        with torch.amp.autocast("cuda", dtype=torch.float16):  # fp16 -> bf16 on the cpu
            assert lin(x).dtype == torch.bfloat16
        with torch.cuda.amp.autocast():
            assert lin(x).dtype == torch.bfloat16
        with torch.autocast("cuda", enabled=False):
            assert lin(x).dtype == torch.float32
        for scaler in (torch.cuda.amp.GradScaler(), torch.amp.GradScaler("cuda", 2.0**10, 2.0, 0.5, 10, True)):
            assert not scaler.is_enabled()
            steps = []  # a stand-in optimizer: torch.optim would import torch._dynamo (seconds)
            opt = type("Opt", (), {"step": lambda self: steps.append(1), "param_groups": []})()  # noqa: B023 - used in this iteration
            loss = lin(x).sum()
            assert scaler.scale(loss) is loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            assert steps == [1] and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16


def test_backend_mapping():
    m = rt._Mapper("cuda", "cpu", torch.device)
    assert [m.backend(b) for b in ("nccl", "hccl", "gloo", None)] == ["gloo", "gloo", "gloo", None]
    assert m.backend("cuda:nccl,cpu:gloo") == "cpu:gloo"
    n = rt._Mapper("cuda", "npu", torch.device)
    assert n.backend("nccl") == "hccl" and n.backend("cuda:nccl,cpu:gloo") == "npu:hccl,cpu:gloo"
    assert n.map("cuda:3") == "npu:3" and n.map(torch.device("cuda", 1)) == "npu:1" and n.map("cpu") == "cpu"


def _store(tmp_path) -> dict:
    """A world of one in this process: a file store (no port to race for) and a bounded wait, so a
    stuck collective fails the test instead of holding the suite."""
    return {"init_method": f"file://{tmp_path / 'store'}", "rank": 0, "world_size": 1, "timeout": timedelta(seconds=60)}


def test_init_process_group_and_ddp(tmp_path):
    with redirect():
        dist.init_process_group(backend="nccl", device_id=torch.device("cuda", 0), **_store(tmp_path))
        try:
            assert dist.get_backend() == "gloo"
            dist.barrier(device_ids=[0])
            g = dist.new_group([0], backend="nccl")
            assert dist.get_backend(g) == "gloo"
            model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2).cuda(), device_ids=[0], output_device=0)
            model(torch.ones(1, 2, device="cuda")).sum().backward()
            t = torch.ones(2, device="cuda")
            dist.all_reduce(t)
            assert t.tolist() == [1.0, 1.0]
        finally:
            dist.destroy_process_group()


def test_torch_load_map_location(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"w": torch.arange(3)}, path)
    with redirect():
        for loc in ("cuda", "cuda:0", torch.device("cuda"), {"cpu": "cuda:0"}, None):
            assert torch.load(path, map_location=loc)["w"].device.type == "cpu"
        assert torch.load(path, "cuda:0")["w"].tolist() == [0, 1, 2]


def test_dataloader_pin_memory():
    ds = torch.utils.data.TensorDataset(torch.arange(4.0))
    with redirect():
        batches = list(torch.utils.data.DataLoader(ds, batch_size=2, pin_memory=True))
    assert [b[0].tolist() for b in batches] == [[0.0, 1.0], [2.0, 3.0]]


def test_npu_emulation():
    with redirect("npu", "cpu"):
        import torch_npu

        assert torch_npu.EMULATED and torch.npu.EMULATED and torch_npu.npu is torch.npu
        import torch.npu as npu_mod  # the import statement works too

        assert npu_mod is torch.npu and torch.npu.is_available() and torch.npu.device_count() >= 1
        torch.npu.set_device("npu:0")
        torch_npu.npu.synchronize()
        assert torch.npu.get_device_capability() is None  # as torch_npu
        d = torch.device("npu:0")
        assert isinstance(d, torch.device) and d.type == "cpu"
        assert torch.device("npu", 1).type == "cpu" and torch.device("cpu").type == "cpu"
        assert pickle.loads(pickle.dumps(d)) == d
        buf = io.BytesIO()
        torch.save({"d": d}, buf)
        x = torch.ones(2, device="npu:0").npu()
        assert x.device.type == "cpu" and x.is_npu and x.type() == "torch.npu.FloatTensor"
        m = nn.Linear(2, 2).npu().to("npu").to(torch.device("npu:0"))
        with torch.autocast(device_type="npu", dtype=torch.bfloat16):
            assert m(x).dtype == torch.bfloat16
        with torch.npu.amp.autocast():
            assert m(x).dtype == torch.bfloat16
        assert not torch.npu.amp.GradScaler().is_enabled()
        torch.npu.config.allow_internal_format = False
        with pytest.raises(AttributeError, match="not emulated"):
            torch_npu.npu_fusion_attention  # noqa: B018
        # Plain cuda code is *not* redirected (as on a real NPU machine) until transfer_to_npu.
        assert not torch.cuda.is_available()
        from torch_npu.contrib import transfer_to_npu  # noqa: F401

        assert rt.current("cuda") is not None and torch.ones(1).cuda().device.type == "cpu"
    assert rt.current() is None and "torch_npu.contrib.transfer_to_npu" not in sys.modules


def test_hccl_to_gloo_under_npu_emulation(tmp_path):
    with redirect("npu", "cpu"):
        dist.init_process_group("hccl", **_store(tmp_path))
        try:
            assert dist.get_backend() == "gloo"
            ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2).npu(), device_ids=[0])
            ddp(torch.ones(1, 2, device="npu")).sum().backward()
        finally:
            dist.destroy_process_group()


def test_cuda_to_emulated_npu_chain():
    """Target npu uses torch.npu; here that is the emulation, so the chain ends on the cpu."""
    with redirect("npu", "cpu"), redirect("cuda", "npu") as h:
        assert h.target == "npu" and h.emulated
        assert torch.cuda.device_count() == torch.npu.device_count()
        assert torch.ones(2, device="cuda:0").device.type == "cpu"
        assert torch.ones(1).cuda().is_cuda
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16
    assert rt.current() is None


def test_errors():
    with pytest.raises(RedirectError, match="source"):
        install("rocm")
    with pytest.raises(RedirectError, match="target"):
        install("cuda", "xpu")
    with pytest.raises(RedirectError, match="both"):
        install("npu", "npu")
    if "torch_npu" not in sys.modules:
        with pytest.raises(RedirectError, match="torch_npu"):
            install("cuda", "npu")
    outer = install("cuda")
    try:
        with pytest.raises(RedirectError, match="already"):
            install("cuda")
        inner = install("npu")
        with pytest.raises(RedirectError, match="innermost"):
            outer.remove()
        inner.remove()
    finally:
        outer.remove()
    assert rt.current() is None and not _get_current_function_mode_stack()


def test_foreign_mode_blocks_removal():
    from torch.overrides import TorchFunctionMode

    h = install()
    mode = TorchFunctionMode()
    mode.__enter__()
    try:
        with pytest.raises(RedirectError, match="TorchFunctionMode"):
            h.remove()
    finally:
        mode.__exit__(None, None, None)
        h.remove()
    assert not _get_current_function_mode_stack()


def test_remove_from_another_thread_is_refused():
    import threading

    h = install()
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RedirectError, h.remove)))
    t.start()
    t.join()
    assert errors and h.active
    h.remove()
    assert not h.active


def test_not_applied_at_import():
    assert rt.current() is None
    assert not torch.cuda.is_available() and not hasattr(torch, "npu")
    assert os.environ.get("PARABENCH_SMOKE_REDIRECT") is None


# --- Megatron-Core 0.16.1 on the cpu (docs/sources.md#megatron-on-cpu) -------------------------------

_MEGATRON_BUILD = """
import torch, torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig


def build_gpt(tp, dropout=0.0, bf16=False):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(123)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        use_cpu_initialization=True, bias_activation_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        hidden_dropout=dropout, attention_dropout=dropout, tensor_model_parallel_size=tp,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=128,
        max_sequence_length=16, position_embedding_type="rope", share_embeddings_and_output_weights=False,
    ).cuda()
    return cfg, model


def batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 16), generator=g).cuda()
    labels = torch.randint(0, 128, (2, 16), generator=g).cuda()
    pos = torch.arange(16, device="cuda").unsqueeze(0).expand(2, -1)
    return tokens, pos, labels
"""

_MEGATRON_RUN = (
    _MEGATRON_BUILD
    + '''
import json, sys
import torch.multiprocessing as mp
from parabench.redirect import current, redirect


def train_steps():
    """bf16 params, dropout (RNG tracker forks), Megatron DDP and mixed-precision optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg, model = build_gpt(1, dropout=0.1, bf16=True)
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True), [model])
    tokens, pos, labels = batch()
    out = {"losses": [], "ok": [], "grad_norms": []}
    for _ in range(2):
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        model.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        out["losses"].append(loss.item())
        out["ok"].append(bool(ok))
        out["grad_norms"].append(float(grad_norm))
    out["devices"] = sorted({p.device.type for p in model.parameters()})
    parallel_state.destroy_model_parallel()
    return out


def run(rank, world, port, q):
    torch.set_num_threads(1)
    with redirect("cuda", "cpu"):
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.cuda.set_device(rank)
        result = {"backend": torch.distributed.get_backend()}
        cfg, model = build_gpt(world)
        tokens, pos, labels = batch()
        loss = model(tokens, pos, None, labels=labels).mean()
        loss.backward()
        result["loss"] = loss.item()
        result["grads"] = all(p.grad is not None for p in model.parameters())
        parallel_state.destroy_model_parallel()
        if world == 1:
            result["train"] = train_steps()
        torch.distributed.destroy_process_group()
    result["left_behind"] = current() is not None or torch.cuda.is_available()
    q.put(result)


if __name__ == "__main__":
    out = {}
    for world, port in ((1, int(sys.argv[1])), (2, int(sys.argv[2]))):
        q = mp.get_context("fork").SimpleQueue()
        mp.start_processes(run, args=(world, port, q), nprocs=world, start_method="fork")
        out[world] = [q.get() for _ in range(world)]
    print(json.dumps(out))
'''
)


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory):
    """One interpreter imports megatron-core once and forks: TP=1 (forward+backward, then two
    training steps) and TP=2 over two gloo ranks (forward+backward)."""
    pytest.importorskip("megatron.core")
    script = tmp_path_factory.mktemp("megatron") / "megatron_cpu.py"
    script.write_text(_MEGATRON_RUN)
    res = subprocess.run(
        [sys.executable, "-W", "ignore", str(script), str(_free_port()), str(_free_port())],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.megatron
def test_megatron_gpt_tp1_forward_backward_and_train_steps(megatron_runs):
    """Tiny Llama-shaped GPTModel, gloo world of 1 (init_process_group("nccl") mapped to gloo)."""
    (tp1,) = megatron_runs["1"]
    assert tp1["backend"] == "gloo" and tp1["grads"] and not tp1["left_behind"]
    train = tp1["train"]
    assert train["devices"] == ["cpu"] and all(train["ok"]) and min(train["grad_norms"]) > 0
    # Megatron's mixed-precision optimizer only accepts torch.cuda.*Tensor type() strings.
    assert 4.0 < train["losses"][0] < 5.5 and train["losses"][1] != train["losses"][0]


@pytest.mark.megatron
@pytest.mark.full
def test_megatron_gpt_tp2_matches_tp1(megatron_runs):
    """TP=2 gives the TP=1 loss (Megatron splits the same cpu-initialised master weights)."""
    (tp1,), (a, b) = megatron_runs["1"], megatron_runs["2"]
    assert a["loss"] == b["loss"] and a["grads"] and b["grads"]
    assert abs(a["loss"] - tp1["loss"]) < 1e-4 * abs(tp1["loss"])
