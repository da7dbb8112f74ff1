"""Mixture-of-Experts on deepspeed (docs/moe.md#deepspeed): DeepSpeed-MoE's own layer with
``ep_size = backend.ep``, mapped onto the canonical Mixtral weights. In one process: the engine
starts from the canonical checksum and trains like the canonical model; the weight names, the
model-state and all-to-all formulas by hand; what DeepSpeed refuses, refused before launch. Full
tier: moe-tiny on 2 ranks against ddp at ZeRO 0, 1 and 2 with ep=2 - parity, model states measured =
formula, all-to-all bytes measured = formula, tokens per expert equal to ddp's."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest
from run_matrix import STEPS, assert_parity

from conftest import assert_refused_before_launch, assert_trains_like_the_canonical_model
from parabench import hydraconfig
from parabench.jobs import from_config, model_spec
from parabench.spec import ModelSpec

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip(
        "deepspeed is not installed (pip install --no-build-isolation deepspeed==0.19.8 torch==2.13.0)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.deepspeed

MOE = ["+model=moe-tiny", "backend=deepspeed"]


def _tiny() -> ModelSpec:
    return model_spec(hydraconfig.to_plain(hydraconfig.compose(["+model=moe-tiny"]))["model"])


def _job(*overrides: str):
    return from_config(hydraconfig.to_plain(hydraconfig.compose([*MOE, *overrides])))


# --------------------------------------------------------------------------------------------
# In one process (no workers).
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _engine_in_process(job, tmp_path: Path, monkeypatch):
    """deepspeed's engine for ``job`` in this process, on a one-rank gloo group (closed afterwards)."""
    import datetime

    import torch.distributed as dist

    from parabench.adapters.base import WorkerContext
    from parabench.adapters.deepspeed import DeepSpeedAdapter
    from parabench.devices import DEVICES

    for key, value in {**DeepSpeedAdapter.launch_env(job), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        ctx = WorkerContext(job=job, rank=0, world_size=1, local_rank=0, device=DEVICES["cpu"](0), run_dir=tmp_path)
        yield DeepSpeedAdapter.create_engine(ctx)
    finally:
        dist.destroy_process_group()


def test_deepspeed_moe_engine_in_process_matches_the_canonical_model(tmp_path, monkeypatch):
    """World of 1, ZeRO-2: DeepSpeed's MoE layers built from the canonical weights give the canonical
    checksum back, every layer is DeepSpeed's own ``MoE``, and 3 AdamW steps follow the canonical
    torch model's training loss (cross entropy + coef x Mixtral's load-balancing loss)."""
    from parabench.spec import resolve_device

    job = resolve_device(_job("data.seq_len=32", "data.global_batch_size=4", "launcher.nproc_per_node=1"), "cpu")
    with _engine_in_process(job, tmp_path, monkeypatch) as engine:
        from deepspeed.moe.layer import MoE

        assert [type(layer.block_sparse_moe.moe) for layer in engine.engine.module.model.layers] == [MoE, MoE]
        assert engine.engine.has_moe_layers
        assert_trains_like_the_canonical_model(engine, job)
        # the routed tokens of the 3 steps, counted once: k x 4 rows x 32 tokens per layer and step
        assert [sum(layer) for layer in engine.tokens_per_expert()] == [3 * 2 * 4 * 32] * 2


def test_deepspeed_expert_names_map_onto_the_canonical_experts():
    """Expert-parallel rank r's local expert j is canonical expert r x E / ep + j; the gate's wg is
    the canonical router; everything else keeps its name."""
    from parabench.adapters.deepspeed_moe import canonical_name

    tiny, local = _tiny(), "model.layers.1.block_sparse_moe.moe.deepspeed_moe.experts.deepspeed_experts.{}.w3.weight"
    assert canonical_name(local.format(1), tiny, ep=2, ep_rank=1) == (
        "model.layers.1.block_sparse_moe.experts.3.w3.weight",
        True,
    )
    assert canonical_name(local.format(0), tiny, ep=4, ep_rank=2)[0].endswith("experts.2.w3.weight")
    assert canonical_name(local.format(1), tiny, ep=1, ep_rank=0)[0].endswith("experts.1.w3.weight")
    gate = "model.layers.0.block_sparse_moe.moe.deepspeed_moe.gate.wg.weight"
    assert canonical_name(gate, tiny, ep=2, ep_rank=1) == ("model.layers.0.block_sparse_moe.gate.weight", False)
    assert canonical_name("lm_head.weight", tiny, ep=2, ep_rank=1) == ("lm_head.weight", False)


def test_deepspeed_moe_model_state_formula_by_hand():
    """moe-tiny, 2 ranks, ep=2, fp32: each rank holds the non-expert parameters and 2 of the 4
    experts of each layer; ZeRO splits the former over both ranks, the experts over 2 / 2 = 1."""
    from parabench.adapters.deepspeed import zero_formula

    tiny = _tiny()
    experts = 2 * 4 * 3 * 256 * 128  # layers x experts x (w1, w2, w3) x intermediate x hidden
    dense, mine = tiny.num_params() - experts, experts // 2
    two = ["backend.ep=2", "launcher.nproc_per_node=2"]
    want = {
        0: (4 + 4 + 8) * (dense + mine),
        1: (4 + 4) * (dense + mine) + 12 * (dense / 2 + mine),
        2: 4 * (dense + mine) + (4 + 12) * (dense / 2 + mine),
    }
    for stage, value in want.items():
        assert zero_formula(_job(*two, f"backend.zero_stage={stage}")).bytes == value, stage
    # ep = 1 on 2 ranks: all experts on each rank, partitioned over both like the rest
    assert zero_formula(_job("launcher.nproc_per_node=2")).bytes == 4 * tiny.num_params() + 16 * tiny.num_params() / 2


def test_deepspeed_all_to_all_formula_by_hand():
    """Per MoE layer forward: the [E, C, h] dispatch buffer out and the expert output back, both again
    in the backward; fp32 moe-tiny (E 4, h 128), capacities 70 and 64 for two layer forwards."""
    from parabench.adapters.deepspeed_moe import all_to_all_bytes

    assert all_to_all_bytes(_tiny(), [70, 64], 4) == 4 * 4 * 128 * 4 * (70 + 64)
    assert all_to_all_bytes(_tiny(), [], 4) == 0


INVALID = {
    "ep not dividing the experts": (
        ["backend.ep=3", "launcher.nproc_per_node=3", "data.global_batch_size=6"],
        "backend.ep",
    ),
    "ep not dividing the world": (["backend.ep=4", "launcher.nproc_per_node=2"], "backend.ep"),
    "ep 0": (["backend.ep=0"], "backend.ep"),
    "ZeRO-3 (DeepSpeed refuses native MoE)": (["backend.zero_stage=3"], "backend.zero_stage"),
    "ZeRO-2 without contiguous gradients": (["backend.contiguous_gradients=false"], "backend.contiguous_gradients"),
    "bf16": (["run.precision=bf16"], "run.precision"),
    "offload": (["backend.offload_optimizer=cpu"], "backend.offload_optimizer"),
    "activation checkpointing": (["backend.activation_checkpointing=true"], "backend.activation_checkpointing"),
    "checkpoints": (["run.checkpoint.every=5"], "run.checkpoint.every"),
    "top-1": (["model.num_experts_per_tok=1"], "model.num_experts_per_tok"),
    # "+": moe-tiny.yaml has no such key (without it Hydra's own "Could not override" named the key)
    "shared expert": (["+model.shared_expert_intermediate_size=64"], "model.shared_expert_intermediate_size"),
    "top-k weights not renormalised": (["+model.norm_topk_prob=false"], "model.norm_topk_prob"),
}


@pytest.mark.parametrize("case", INVALID)
def test_deepspeed_moe_layouts_it_cannot_run_are_refused_before_launch(tmp_path, capsys, case):
    args, key = INVALID[case]
    assert_refused_before_launch([*MOE, *args], key, tmp_path, capsys)


def test_expert_parallelism_needs_a_moe_model(tmp_path, capsys):
    args = ["+model=llama", "backend=deepspeed", "backend.ep=2", "launcher.nproc_per_node=2"]
    assert "needs a MoE model" in assert_refused_before_launch(args, "backend.ep", tmp_path, capsys)


# --------------------------------------------------------------------------------------------
# Full tier: 2 ranks against ddp.
# --------------------------------------------------------------------------------------------
COMMON = ["+model=moe-tiny", "data.seq_len=64", "run.warmup_steps=0", f"run.steps={STEPS}", "optim.lr=1e-3"]
STAGES = (0, 1, 2)


@pytest.fixture(scope="module")
def ds_runs(shared_run) -> dict[str, dict]:
    """moe-tiny on 2 ranks, STEPS steps each (lr 1e-3, as tests/test_moe.py): ddp and deepspeed ep=2 at
    ZeRO 0, 1 and 2; ddp and ZeRO-0 again without gradient clipping (the session's shared runs: the
    ddp reference is test_moe's)."""
    runs = {"ddp": ["backend=ddp"], "ddp-noclip": ["backend=ddp", "optim.grad_clip=0"]}
    runs.update({f"zero{s}": ["backend=deepspeed", "backend.ep=2", f"backend.zero_stage={s}"] for s in STAGES})
    runs["zero0-noclip"] = [*runs["zero0"], "optim.grad_clip=0"]
    return {
        label: shared_run([*COMMON, *args, "launcher.nproc_per_node=2", "tracking.enabled=false"])
        for label, args in runs.items()
    }


@pytest.mark.full
@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_ep2_matches_ddp(ds_runs, stage):
    """The canonical checksum, step 0 within 1e-6 and step 10 within 1e-4 relative of ddp's (the dense
    deepspeed parity bounds). ZeRO-1/2 also route every step's tokens to the same experts as ddp."""
    ds = ds_runs[f"zero{stage}"]
    assert ds["backend"] == "deepspeed" and ds["comm_measured"]["all_to_all"]["calls"] > 0  # ep=2
    assert_parity(ds_runs["ddp"], ds, first=1e-6, after_ten=1e-4)
    if stage:
        assert ds["moe_tokens_per_expert"] == ds_runs["ddp"]["moe_tokens_per_expert"]


@pytest.mark.full
def test_deepspeed_zero0_differs_from_ddp_only_by_its_clipping_norm(ds_runs):
    """ZeRO-0 clips with DeepSpeed's ``runtime.utils.clip_grad_norm_``, whose norm is the mean of the
    ranks' local norms (each rank's counts its own experts), not the norm of the whole gradient as
    torch's and ZeRO-1/2's: measured with clipping, step 10 at 1.1e-5 of ddp's, at most 1.1e-4 (step
    14), tokens routed differently. Without clipping on both, every step's tokens go to the same
    experts as ddp's, step 10 within 1e-6 and every step within 1e-5 relative (measured: 3.2e-8 at
    step 10, at most 9.2e-7 at step 14 - fp32 rounding of another reduction order, grown by 20 AdamW
    steps at lr 1e-3 without clipping)."""
    ref, ds = ds_runs["ddp-noclip"], ds_runs["zero0-noclip"]
    assert ds["initial_checksum"] == ref["initial_checksum"] and len(ds["losses"]) == STEPS
    assert ds["moe_tokens_per_expert"] == ref["moe_tokens_per_expert"]
    rel = [abs(got - want) / abs(want) for got, want in zip(ds["losses"], ref["losses"], strict=True)]
    assert rel[10] <= 1e-6 and max(rel) <= 1e-5, rel


@pytest.mark.full
@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_ep2_model_states_equal_the_formula(ds_runs, stage):
    """Each rank holds the non-expert parameters and 2 of the 4 experts per layer (Psi_held); ZeRO
    partitions the former over both ranks, the experts over 2 / 2 = 1 (Psi_part). ZeRO-0: params +
    grads + AdamW moments = the formula, 16 x Psi_held. ZeRO-1/2: params = 4 x Psi_held and fp32
    masters + moments = 12 x Psi_part, to the byte (no alignment padding at moe-tiny's sizes); the
    gradients held after a backward are the partition's, 4 x Psi_part, plus the parameter that
    straddles the no-decay group's partition boundary (a norm vector: the measurement counts a
    view's whole storage) - at stage 1 too, where the ZeRO paper counts 2b Psi (module doc)."""
    ds, tiny = ds_runs[f"zero{stage}"], _tiny()
    experts = 2 * 4 * 3 * 256 * 128
    held, part = tiny.num_params() - experts // 2, (tiny.num_params() - experts) / 2 + experts // 2
    for rank in ds["model_state_per_rank"]:
        assert rank["detail"].get("padding_elements", 0) == 0, rank
        if stage == 0:
            total = rank["params"] + rank["grads"] + rank["optimizer"]
            assert total == ds["model_state_expected_bytes"] == 16 * held, rank
            continue
        assert rank["params"] == 4 * held and rank["optimizer"] == 12 * part, rank
        assert 0 <= rank["grads"] - 4 * part <= 4 * tiny.hidden_size, rank
    if stage == 2:
        assert ds["model_state_expected_bytes"] == 4 * held + 16 * part


@pytest.mark.full
@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_ep2_all_to_all_bytes_equal_the_formula(ds_runs, stage):
    """The all-to-all bytes per step, mean over the ranks, equal 4 x E x C x h x 4 per layer forward
    (C the dropless capacity of that forward from the canonical routing) to the byte; 8 calls per
    step (2 layers x dispatch and combine, forward and backward); and at least what T x k rows
    alone would move (the padded buffer holds every routed row)."""
    ds = ds_runs[f"zero{stage}"]
    want = ds["comm_all_to_all_formula_bytes"]
    assert want and ds["comm_all_to_all_rank_mean_bytes"] == want and ds["comm_all_to_all_diff_bytes"] == 0, ds
    assert ds["comm_measured"]["all_to_all"]["calls"] == 8
    assert want >= 2 * 4 * (2 * 64 * 2) * 128 * 4  # layers x 4 calls x T x k rows x h x fp32
    # the gradient reduction (and ZeRO-1/2's parameter gather) of the busiest rank, per kind, over its
    # links = bench run's formula: the experts' groups span dp / ep = 1 rank and move nothing
    measured, formula = ds["comm_measured"], ds["comm_formula"]
    for kind in ("all_reduce", "all_gather") if stage else ("all_reduce",):
        assert measured[kind]["bus_bytes"] == formula[kind]["bus_bytes"], (kind, measured[kind], formula[kind])


# the non-expert parameters of moe-tiny (h 128, 2 layers, 4 query / 2 key-value heads of 32, 4 experts,
# vocabulary 2,048, untied): norms, q, k + v, o, router per layer; the final norm, embedding and lm_head
DENSE = 2 * (2 * 128 + 128 * 128 + 2 * 64 * 128 + 128 * 128 + 4 * 128) + 128 + 2 * 2048 * 128


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_moe_communication_formula_by_hand(stage):
    """bench run's formula (parabench.run.comm_report.formula) for ep=2 on 2 ranks: the non-expert gradients
    all-reduced over dp (each AdamW group flattened and padded to 2 x dp: 624,256 elements, already a
    multiple of 4), ZeRO-1/2's updated non-expert partitions all-gathered; the experts' groups are
    partitioned and reduced over dp / ep = 1 rank, where nothing moves."""
    from parabench.run.comm_report import formula

    got = formula(_job(f"backend.zero_stage={stage}", "backend.ep=2", "launcher.nproc_per_node=2"))
    want = {"all_reduce": (4 * DENSE, 1)} | ({"all_gather": (4 * DENSE, 1)} if stage else {})
    assert DENSE == 624_256 and {k: (v["bytes"], v["calls"]) for k, v in got.items()} == want


def test_dense_deepspeed_keeps_its_formula():
    """A dense model's formula is unchanged by the MoE terms (ep = 1, no experts)."""
    from parabench.adapters.deepspeed import zero_formula

    job = from_config(
        hydraconfig.to_plain(hydraconfig.compose(["+model=llama", "backend=deepspeed", "launcher.nproc_per_node=2"]))
    )
    psi = job.model.num_params()
    assert not job.model.is_moe and zero_formula(job).bytes == 4 * psi + 16 * psi / 2


def test_every_subgroup_a_worker_creates_gets_the_jobs_collective_timeout(monkeypatch):
    """DeepSpeed makes its expert- and data-parallel groups with new_group(ranks) and no timeout, which
    torch gave its 30-minute default: a rank hung in an all-to-all held its peer that long, whatever
    launcher.collective_timeout_s said. A worker's TorchComm makes the job's timeout every new group's
    default (one gloo rank in this process; torch's defaults restored after)."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from parabench.adapters.base import TorchComm
    from parabench.devices import DEVICES
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import prepare

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        monkeypatch.setattr(distributed_c10d, name, getattr(distributed_c10d, name))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    for key, value in {**env, "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(key, value)
    job = prepare(to_plain(compose(["+model=llama", "launcher.collective_timeout_s=42", "launcher.dry_run=true"])))
    comm = TorchComm(job, DEVICES["cpu"](0))
    try:
        group = dist.new_group(ranks=[0])  # as deepspeed/utils/groups.py makes its groups
        assert distributed_c10d._get_default_timeout(dist.Backend.GLOO) == datetime.timedelta(seconds=42)
        assert group._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(seconds=42)
    finally:
        comm.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
