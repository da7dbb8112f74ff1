"""FSDP2 + tensor parallel (backend=fsdp backend.tp=N, torchtitan's 2-D layout; docs/plan.md#fsdp2-tensor-parallel):
the refusals before launch, the model-state formula and the planner's fsdp x tp layouts (unit), and
2 and 4 ranks trained against ddp (full tier)."""

from __future__ import annotations

import copy
import math

import pytest
from run_matrix import STEPS, assert_parity

from conftest import FAST, assert_refused_before_launch, bench, summaries
from parabench.adapters.registry import get_adapter
from parabench.hydraconfig import compose, to_plain
from parabench.jobs import prepare

# The llama preset (conf/model/llama.yaml) by hand: hidden 256, 8 query heads and 4 key/value heads of
# 32, MLP width 688, 4 layers. One layer's split projections: q and o 256 x 256, k and v 256 x 128,
# gate, up and down 256 x 688 (Shoeybi et al. 2019, sec. 3: everything else stays whole).
SPLIT_PER_LAYER = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688
LAYERS = 4


def _job(world: int, *overrides: str, **options):
    plain = to_plain(compose(["+model=llama", "backend=fsdp", *overrides]))
    cfg = copy.deepcopy(plain)
    cfg["backend"].update(options)
    cfg["launcher"].update(nproc_per_node=world, dry_run=True)
    cfg["device"]["type"] = "cpu"
    cfg["tracking"]["enabled"] = False
    return prepare(cfg)


@pytest.mark.parametrize(
    ("args", "must_name"),
    [
        (["backend.tp=3", "launcher.nproc_per_node=3"], "model.num_attention_heads=8 is not divisible"),
        (["backend.tp=8", "launcher.nproc_per_node=8"], "model.num_key_value_heads=4 is not divisible"),
        (
            ["backend.tp=2", "launcher.nproc_per_node=2", "model.intermediate_size=687"],
            "model.intermediate_size=687 is not divisible",
        ),
        (["backend.tp=2", "launcher.nproc_per_node=3"], "world size 3 is not divisible by tp=2"),
    ],
    ids=["heads", "kv-heads", "mlp-width", "world"],
)
def test_a_tp_that_does_not_split_the_model_is_refused_before_launch(args, must_name, tmp_path, capsys):
    base = ["+model=llama", "backend=fsdp", "device=cpu"]
    err = assert_refused_before_launch([*base, *args], must_name, tmp_path, capsys)
    assert "backend.tp" in err


def test_parallel_dims_and_model_state_formula_by_hand():
    job = _job(4, tp=2)
    assert (job.parallel.world_size, job.parallel.tp, job.parallel.dp) == (4, 2, 2)
    psi_tp = job.model.num_params() - LAYERS * SPLIT_PER_LAYER // 2  # one tp rank's parameters
    formula = get_adapter("fsdp").expected_model_state(job)
    assert formula.bytes == 16 * psi_tp / 2  # fp32 params, grads, AdamW moments over dp = 2
    assert "Psi_tp" in formula.formula and "fsdp2-tensor-parallel" in formula.source
    # tp = 1 is FSDP as before: the whole model over the world
    assert get_adapter("fsdp").expected_model_state(_job(2)).bytes == 16 * job.model.num_params() / 2


def test_planner_states_are_the_adapters_formula_plus_fsdp2_padding():
    from parabench.adapters.fsdp_profile import PROFILE

    pads = {}
    for world, tp in ((2, 2), (4, 2), (6, 2), (4, 4)):
        job = _job(world, "data.global_batch_size=12", tp=tp)
        states = PROFILE.states(job)
        formula = get_adapter("fsdp").expected_model_state(job).bytes
        pads[world, tp] = states.total - formula
        # FSDP2 pads each parameter's dim 0 to a multiple of dp: less than one row of it per rank
        rows = sum(math.prod(shape[1:]) for shape in job.model.parameter_shapes().values())
        assert 0 <= pads[world, tp] < 16 * rows, (world, tp, states, formula)
    assert pads[2, 2] == 0 and pads[4, 2] == 0  # over dp 1 or 2 nothing to pad: every dim is even
    assert pads[6, 2] > 0  # dp 3 pads dim 0 (FSDP2), e.g. gate/up's 344 rows to 345


def test_the_search_offers_fsdp_with_tensor_parallel_and_its_communication():
    from parabench.plan.cluster import load
    from parabench.plan.estimate import Calibration
    from parabench.plan.search import backend_defaults, describe, search

    user = ["+model=llama3-8b", "data.global_batch_size=32", "data.seq_len=4096", "run.precision=bf16"]
    base = backend_defaults(["fsdp"], [*user, "tracking.enabled=false"])
    found = search(base, load("h100-sxm"), 16, [1], 989.0, Calibration())
    plain = [e for e in found.ranked + found.unfit if _plain_fsdp(e.job.backend.options)]
    fsdp = {e.job.parallel.tp: e for e in plain}
    assert len(fsdp) == len(plain) and set(fsdp) == {1, 2, 4, 8}  # tp inside the node's 8 GPUs
    row = fsdp[2]
    assert describe(row).startswith("fsdp tp2 dp8") and "backend.tp=2" in found.overrides[id(row)]
    tp = [c for c in row.comm.collectives if c.group == "tp"]
    # Megatron's f/g: 2 forward + 2 backward all-reduces of the b x s x h bf16 activation per layer
    # and micro-batch (32 layers, 4 micro-batches: 32 / (1 x dp 8)); the embedding, lm_head and loss
    # are not split, so none of Megatron's vocab-parallel collectives
    assert [(c.kind, c.calls, c.size_bytes) for c in tp] == [("all_reduce", 4 * 32 * 4, 4096 * 4096 * 2)]
    assert row.overlap.total["tp"] > 0 and row.overlap.hidden["tp"] == 0  # exposed, as for megatron
    # the dp group synchronises one tp rank's shard: fewer elements than at tp 1
    assert row.states.elements < fsdp[1].states.elements


def _plain_fsdp(o) -> bool:
    return o.reshard_after_forward and not o.activation_checkpointing and not o.cpu_offload


def test_the_search_counts_the_tp_the_model_refuses():
    from parabench.plan.cluster import load
    from parabench.plan.estimate import Calibration
    from parabench.plan.search import backend_defaults, search

    base = backend_defaults(["fsdp"], ["+model=llama", "data.global_batch_size=8", "tracking.enabled=false"])
    found = search(base, load("h100-sxm"), 8, [1], 989.0, Calibration())
    assert {e.job.parallel.tp for e in found.ranked + found.unfit} == {1, 2, 4}
    assert found.invalid.get("backend.tp", 0) > 0  # tp 8 does not divide the 4 key/value heads


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp2xdp2"])
def fsdp_tp(request, tmp_path_factory) -> dict:
    """backend=fsdp backend.tp=2 at the run matrix's geometry (tp2: dp 1, 2 micro-batches; tp2xdp2: 4
    ranks, oversubscribed): runs of their own, the matrix has none with tensor parallelism."""
    results = tmp_path_factory.mktemp(f"fsdp_tp_x{request.param}")
    args = [*FAST, f"run.steps={STEPS}", "backend=fsdp", "backend.tp=2", f"launcher.nproc_per_node={request.param}"]
    proc = bench(["run", *args, "tracking.enabled=false"], results)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (summary,) = summaries(results).values()
    return summary


@pytest.mark.matrix("ddp")
@pytest.mark.full
def test_fsdp_tp_matches_ddp_and_holds_its_formula(matrix, fsdp_tp):
    ddp = matrix["ddp"].summary
    # ddp/fsdp's bounds (test_e2e): tensor parallelism only reorders the row-parallel sums (measured
    # 2026-12-06: at most 6.3e-8 relative at steps 0, 5, 10, 15, at both world sizes)
    assert_parity(ddp, fsdp_tp, first=1e-6, after_ten=1e-4)
    n, dp = ddp["num_params"], fsdp_tp["world_size"] // 2
    expected = 16 * (n - LAYERS * SPLIT_PER_LAYER // 2) / dp
    assert fsdp_tp["model_state_expected_bytes"] == expected
    for rank in fsdp_tp["model_state_per_rank"]:  # measured: every split dim is even, so FSDP2 pads nothing
        assert rank["params"] + rank["grads"] + rank["optimizer"] == expected, rank


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_the_planners_tp_collectives_are_the_ones_dtensor_issues(recompute):
    # One micro-batch's forward and backward of the adapter's split model on a 2-rank world of
    # torch's fake process group (collectives issued, nothing sent), counted by DTensor's
    # CommDebugMode: the planner's per-layer all-reduces (Megatron's f and g; with activation
    # checkpointing the attention's g once more: torch's recompute stops before the MLP's) and nothing
    # else. A per-projection input split would add 3 backward ones.
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parabench.adapters.fsdp_engine import apply_tensor_parallel
    from parabench.adapters.fsdp_profile import PROFILE
    from parabench.commvolume import Batch, step_comm
    from parabench.model import build_llama, set_activation_checkpointing

    job = _job(2, "model.vocab_size=256", tp=2, activation_checkpointing=recompute)
    prof = PROFILE
    planned = step_comm(job.model, prof.layout(job), Batch(16, 2, 1), prof.widths(job))
    tp_calls = {c.kind: c.calls for c in planned.collectives if c.group == "tp"}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = build_llama(job.model)
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,)))
        set_activation_checkpointing(model, recompute)
        with CommDebugMode() as comm:
            model(torch.randint(0, 256, (2, 16))).float().sum().backward()
        issued = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    finally:
        dist.destroy_process_group()
    assert issued == tp_calls == {"all_reduce": LAYERS * (4 + recompute)}
