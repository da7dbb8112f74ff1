"""megatron-core's MoE layer with the distributed optimizer and with pipeline stages
(docs/moe.md#megatron). The distributed optimizer: the experts' fp32 states sharded over the
expert-data-parallel group (dp / ep ranks), the dense ones over dp - the formula by hand, parity with
ddp on 2 ranks, the measured bytes, a killed run resumed bitwise through megatron-core's sharded state
dict and its checkpoint converted to ddp. Pipeline stages: each stage's experts, and Mixtral's
load-balancing loss over all layers exchanged between the stages - parity with ddp on 2 ranks.
Expert tensor parallelism (tp=2 under sequence parallelism): parity, and the token dispatcher's
gathers over the tensor ranks in the communication formula. Conversion into megatron's experts: ddp
and fsdp checkpoints continued on ep=2.

moe-tiny (conf/model/moe-tiny.yaml): h = 128, 2 layers, 4 query / 2 key-value heads of d = 32, 4
experts of width 256, top-2, vocabulary 2,048, untied embeddings.
"""

from __future__ import annotations

import pytest
from run_matrix import STEPS, assert_parity
from test_moe import killed_resumed_and_converted_to_ddp, train_moe_runs

from conftest import assert_refused_before_launch, bench, run_ok
from parabench import hydraconfig
from parabench.jobs import from_config

H, FFN, L, E, V = 128, 256, 2, 4, 2048
EXPERT = 3 * H * FFN  # w1, w3 and w2 of one expert
# norms, q, k + v, o, router per layer; the final norm, embedding and lm_head
DENSE = L * (2 * H + H * H + 2 * 64 * H + H * H + E * H) + H + 2 * V * H

MOE_COMMON = ["+model=moe-tiny", "data.seq_len=64", "run.warmup_steps=0", f"run.steps={STEPS}", "optim.lr=1e-3"]
DISTOPT = ["backend=megatron", "backend.distributed_optimizer=true"]


def _job(*overrides: str):
    return from_config(hydraconfig.to_plain(hydraconfig.compose(["+model=moe-tiny", *DISTOPT, *overrides])))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # ep=2 on 2 ranks: 2 of 4 experts per layer, their expert-data-parallel group is one rank (the
        # experts' states whole), the dense states over dp = 2: 4 param + 4 grad held, 8 moments sharded
        (
            ["backend.ep=2", "launcher.nproc_per_node=2"],
            8 * (DENSE + 2 * L * EXPERT) + 8 * DENSE / 2 + 8 * 2 * L * EXPERT,
        ),
        # ep=2 on 4 ranks: the experts' moments over dp / ep = 2 ranks, the dense ones over 4
        (
            ["backend.ep=2", "launcher.nproc_per_node=4", "data.global_batch_size=8"],
            8 * (DENSE + 2 * L * EXPERT) + 8 * DENSE / 4 + 8 * 2 * L * EXPERT / 2,
        ),
        # ep=1 on 2 ranks: every expert held, sharded over both ranks as the dense states are
        (["launcher.nproc_per_node=2"], 8 * (DENSE + 4 * L * EXPERT) + 8 * (DENSE + 4 * L * EXPERT) / 2),
        # bf16: 2 param + 4 fp32 grad held, 4 fp32 main param + 8 moments sharded
        (
            ["backend.ep=2", "launcher.nproc_per_node=4", "data.global_batch_size=8", "run.precision=bf16"],
            6 * (DENSE + 2 * L * EXPERT) + 12 * DENSE / 4 + 12 * 2 * L * EXPERT / 2,
        ),
    ],
)
def test_distributed_optimizer_formula_shards_the_experts_over_expert_data_parallel_ranks(overrides, expected):
    from parabench.adapters.megatron import MegatronAdapter

    job = _job(*overrides)
    MegatronAdapter.validate(job)  # accepted before launch
    formula = MegatronAdapter.expected_model_state(job)
    assert formula.bytes == expected, (formula.bytes, expected, formula.formula)
    assert "distributed optimizer" in formula.formula
    if job.backend.options.ep > 1:
        assert f"dp/ep = {job.parallel.dp // 2} ranks" in formula.formula


@pytest.fixture(scope="module")
def runs(shared_run) -> dict[str, dict]:
    """moe-tiny on 2 ranks, STEPS steps each: ddp, megatron ep=2 and ep=1 with the distributed optimizer,
    pp=2, and tp=2 (expert tensor parallelism, under sequence parallelism)."""
    runs = {
        "ddp": ["backend=ddp"],
        "ep2": [*DISTOPT, "backend.ep=2"],
        "ep1": DISTOPT,
        "pp2": ["backend=megatron", "backend.pp=2"],
        "tp2": ["backend=megatron", "backend.tp=2", "backend.sequence_parallel=true"],
    }
    return train_moe_runs(shared_run, runs)


@pytest.mark.full
@pytest.mark.parametrize("label", ["ep2", "ep1"])
def test_distributed_optimizer_with_experts_matches_ddp_and_its_formula(runs, label):
    """Same canonical start (the gathered state's checksum, the experts' slices put together over the
    expert-data-parallel group and the experts over the expert-parallel group), the megatron parity
    bounds of tests/test_moe.py against ddp (step 0 within 1e-6, step 10 within 1e-3 relative), and
    each rank's params + grads + AdamW moments = the formula, the experts' moments over dp / ep ranks."""
    mg = runs[label]
    assert mg["backend"] == "megatron" and "distributed optimizer" in mg["model_state_expected_formula"]
    assert_parity(runs["ddp"], mg, first=1e-6, after_ten=1e-3)
    for rank in mg["model_state_per_rank"]:
        assert rank["params"] + rank["grads"] + rank["optimizer"] == mg["model_state_expected_bytes"], rank
    # tokens per expert: the same routing as ddp's, to the token
    assert mg["moe_tokens_per_expert"] == runs["ddp"]["moe_tokens_per_expert"]
    # bench run's communication formula, per kind, is what the busiest rank moved over its links: at
    # ep=2 the experts' reduce-scatter and gather run over a group of dp / ep = 1 rank (nothing moves),
    # and each optimizer of megatron-core's chain gathers every buffer (2 all-gathers per step); at
    # ep=1 the experts sit in the dense buffers (one of each). all_to_all has its own mean-over-ranks check.
    measured, formula = mg["comm_measured"], mg["comm_formula"]
    for kind in ("reduce_scatter", "all_gather"):
        assert measured[kind]["bus_bytes"] == formula[kind]["bus_bytes"], (kind, measured[kind], formula[kind])
    assert formula["all_gather"]["calls"] == {"ep2": 2, "ep1": 1}[label]


KILLED = {"ep2": [*DISTOPT, "backend.ep=2"], "pp2": ["backend=megatron", "backend.pp=2"]}


@pytest.mark.full
@pytest.mark.parametrize("label", KILLED)
def test_experts_killed_resumed_bitwise_and_converted_to_ddp(runs, tmp_path, label):
    """ep=2 with the distributed optimizer (the experts' optimizer states from their own
    DistributedOptimizer), and pp=2 (each stage's experts): checkpointed every 5 steps through
    megatron-core's sharded state dict, rank 1 killed before step 13, launcher.max_restarts=1: resumed
    from step 10, all 20 losses equal to the uninterrupted run's. Then step 10 converted to ddp (the
    slices and stages put together) and continued within the megatron parity bounds of the
    uninterrupted run (the first step within 1e-5, the next nine within 1e-3 relative)."""
    two = [*KILLED[label], "launcher.nproc_per_node=2", "tracking.enabled=false"]
    killed_resumed_and_converted_to_ddp(two, runs[label], tmp_path)


def test_pipeline_stages_with_experts_are_accepted_and_interleaving_refused(tmp_path, capsys):
    from parabench.adapters.megatron import MegatronAdapter

    job = _job("backend.pp=2", "backend.distributed_optimizer=false", "launcher.nproc_per_node=2")
    MegatronAdapter.validate(job)
    # a stage holds half the layers and every expert of them: 16 bytes each (fp32, replicated AdamW)
    per_layer = 2 * H + H * H + 2 * 64 * H + H * H + E * H + E * EXPERT
    assert MegatronAdapter.expected_model_state(job).bytes == 16 * (per_layer + H + V * H)  # the last stage
    four = ["model.num_hidden_layers=4", "backend=megatron", "backend.pp=2", "backend.vpp=2"]
    line = assert_refused_before_launch(
        ["+model=moe-tiny", *four, "launcher.nproc_per_node=2", "data.global_batch_size=8"],
        "backend.vpp",
        tmp_path,
        capsys,
    )
    assert "with a MoE model" in line, line


def _routes_and_trains_like_ddp(mg: dict, ref: dict) -> list[int]:
    """The MoE megatron parity bounds against ddp (step 0 within 1e-6), every loss within 1e-5 relative
    (the bound that catches a load-balancing loss exchanged wrongly between ranks), tokens per expert
    equal to ddp's; each rank's params + grads + AdamW moments."""
    assert_parity(ref, mg, first=1e-6, after_ten=1e-3)
    for step, (got, want) in enumerate(zip(mg["losses"], ref["losses"], strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
    assert mg["moe_tokens_per_expert"] == ref["moe_tokens_per_expert"]
    return [r["params"] + r["grads"] + r["optimizer"] for r in mg["model_state_per_rank"]]


@pytest.mark.full
def test_pipeline_stages_with_experts_match_ddp(runs):
    """pp=2 on 2 ranks (ep=1, dp=1), each stage one layer and its 4 experts: the canonical start, the
    megatron parity bounds, and every one of the 20 losses within 1e-5 relative of ddp's. The tighter
    bound is what catches the load-balancing loss's exchange between the stages: measured 1.2e-7 at
    most, and with the first stage's share of its gradient dropped 4.9e-5 at step 1 (2.7e-5 at step
    10, inside the 1e-3 bound). Tokens per expert summed over the stages equal ddp's; each rank's
    model states at most the formula's (the largest stage's), the last stage's equal to it."""
    mg, ref = runs["pp2"], runs["ddp"]
    held = _routes_and_trains_like_ddp(mg, ref)
    assert max(held) == mg["model_state_expected_bytes"] and len(held) == 2, held


@pytest.mark.full
def test_expert_tensor_parallelism_matches_ddp(runs):
    """tp=2 with sequence parallelism (dp=1): each tensor rank holds every expert's half (fc1's gate/up
    rows, fc2's columns: megatron-core's expert_tensor_parallel_size defaults to tp) and routes its
    sequence slice. The canonical start, every loss within 1e-5 relative of ddp's - the bound that
    catches the load-balancing loss over the slices (measured 1.3e-7 at most; computed per slice, step
    1 was 1.1e-4 off) - tokens per expert equal to ddp's, and each rank's model states = the formula."""
    mg, ref = runs["tp2"], runs["ddp"]
    held = _routes_and_trains_like_ddp(mg, ref)
    assert held == [mg["model_state_expected_bytes"]] * 2, held
    # the communication formula with the token dispatcher's gathers over the tensor ranks
    # (test_the_tensor_parallel_formula_counts_the_dispatchers_gathers): every reduce-scatter, all-gather
    # (with lm_head's wgrad re-gather and the embedding output's backward) and all-reduce (with the
    # sequence-parallel parameters' grads: 6,656 B; cross entropy's 3,072 B) measured = formula; the one
    # all-reduce call more measured is the data-parallel grads' over a one-rank group (dp=1, bus 0 B)
    measured, formula = mg["comm_measured"], mg["comm_formula"]
    for kind, calls, extra in (("reduce_scatter", 24, 0), ("all_gather", 30, 0), ("all_reduce", 7, 1)):
        got, want = measured[kind], formula[kind]
        assert (got["bus_bytes"], got["calls"] - extra) == (want["bus_bytes"], want["calls"]), (kind, measured)
        assert want["calls"] == calls, (kind, formula)
    assert formula["all_reduce"]["bus_bytes"] == 9_728


def test_the_tensor_parallel_formula_counts_the_dispatchers_gathers():
    """Expert tensor parallelism (tp=2 with sequence parallelism, ep=1), moe-tiny, 2 micro-batches of
    b = 2, s = 64 (act = b s h x 4 B): the routed experts' linears do no sequence-parallel collectives
    (megatron-core's explicit_expert_comm), the alltoall dispatcher all-gathers the tensor group's
    T k = 256 rows and their probabilities and reduce-scatters the experts' output (each one's backward
    the other), by hand; measured equal for the reduce-scatters in test_expert_tensor_parallelism_matches_ddp.
    A shared expert is a dense MLP: its sequence-parallel collectives come back."""
    from parabench.run.comm_report import formula

    act, rows = 2 * 64 * H * 4, 2 * 64 * 2
    tp2 = ["backend.tp=2", "backend.sequence_parallel=true", "backend.distributed_optimizer=false"]
    got = formula(_job("launcher.nproc_per_node=2", "data.seq_len=64", *tp2))
    m, layers = 2, L
    # attention: input gathered (fwd), re-gathered (wgrad), output reduce-scatter's backward; the
    # lm_head's input (fwd, re-gathered for its wgrad); the embedding output reduce-scatter's backward;
    # the dispatcher's rows twice and probabilities once per layer
    gathers = m * layers * 3 * act + 3 * m * act + m * layers * (2 * rows * H * 4 + rows * 4)
    # attention: output (fwd), input gather's backward; embedding output; lm_head input grad; dispatcher
    scatters = m * layers * 2 * act + m * act + m * act + m * layers * (2 * rows * H * 4 + rows * 4)
    assert (got["all_gather"]["bytes"], got["all_gather"]["calls"]) == (gathers, m * layers * 6 + 3 * m)
    assert (got["reduce_scatter"]["bytes"], got["reduce_scatter"]["calls"]) == (scatters, m * layers * 5 + 2 * m)
    # the sequence-parallel parameters' grads, one coalesced fp32 all-reduce: 2 norms a layer, the final
    # norm, the routers (E x H a layer) - 1,664 elements, measured in test_expert_tensor_parallelism_matches_ddp
    # and the vocab-parallel cross entropy's three all-reduces of b s fp32 a micro-batch
    sp_grads = (2 * L * H + H + L * E * H) * 4
    assert sp_grads == 6_656
    assert (got["all_reduce"]["bytes"], got["all_reduce"]["calls"]) == (sp_grads + 3 * m * 2 * 64 * 4, 1 + 3 * m)
    shared = formula(
        _job("launcher.nproc_per_node=2", "data.seq_len=64", "+model.shared_expert_intermediate_size=64", *tp2)
    )
    assert shared["all_gather"]["bytes"] - gathers == m * layers * 3 * act  # fc1 in, fc1 wgrad, fc2 out's bwd
    assert shared["reduce_scatter"]["bytes"] - scatters == m * layers * 2 * act


def _round128(n: int) -> int:
    return -(-n // 128) * 128  # a distributed-optimizer buffer on 2 ranks: a multiple of lcm(2, 128)


@pytest.mark.parametrize(
    "overrides, want",
    [
        # a dense and an expert DistributedOptimizer in megatron-core's chain, each gathering every buffer;
        # the experts' reduce-scatter and gather run over dp / ep = 1 rank: nothing moves
        (["backend.ep=2"], {"reduce_scatter": (4 * _round128(DENSE), 1), "all_gather": (4 * _round128(DENSE), 2)}),
        # with overlap_param_gather the forward's pre-hooks gather once
        (
            ["backend.ep=2", "backend.overlap_param_gather=true"],
            {"reduce_scatter": (4 * _round128(DENSE), 1), "all_gather": (4 * _round128(DENSE), 1)},
        ),
        # ep=1: the experts share the dense buffers, over dp
        (
            ["backend.ep=1"],
            {
                "reduce_scatter": (4 * (_round128(DENSE) + _round128(L * E * EXPERT)), 1),
                "all_gather": (4 * (_round128(DENSE) + _round128(L * E * EXPERT)), 1),
            },
        ),
        # no distributed optimizer: the dense gradients' all-reduce only
        (["backend.ep=2", "backend.distributed_optimizer=false"], {"all_reduce": (4 * DENSE, 1)}),
    ],
)
def test_the_communication_formula_follows_megatron_cores_expert_buffers(overrides, want):
    """bench run's formula (parabench.run.comm_report.formula) for moe-tiny on 2 megatron ranks, by hand:
    size per call and calls of each data-parallel kind, measured equal in
    test_distributed_optimizer_with_experts_matches_ddp_and_its_formula (bus bytes per kind)."""
    from parabench.run.comm_report import formula

    got = formula(_job("launcher.nproc_per_node=2", *overrides))
    data_parallel = {k: (v["bytes"] / v["calls"], v["calls"]) for k, v in got.items() if k != "all_to_all"}
    assert data_parallel == want


@pytest.mark.full
@pytest.mark.parametrize("source", ["ddp", "fsdp"])
def test_a_ddp_or_fsdp_checkpoint_converts_to_megatron_ep2_and_continues_like_it(tmp_path, source):
    """bench convert into megatron's experts: moe-tiny trained 20 steps on 2 ``source`` ranks,
    checkpointed at step 10; step 10 converted to megatron ep=2 (each expert rank given its E / ep
    experts and their AdamW moments; checksum read back equal) and continued 10 steps there. From that
    common state megatron follows the source's own steps 10-19: each within 1e-5 relative (measured
    from ddp at most 1.4e-7), the same tokens per expert, and each rank's model states = the formula."""
    saved = ["run.checkpoint.every=10", f"run.checkpoint.dir={tmp_path / 'ckpt'}", "run.checkpoint.keep=0"]
    two = ["launcher.nproc_per_node=2", "tracking.enabled=false"]
    full = run_ok([*MOE_COMMON, f"backend={source}", *two, *saved], tmp_path / source)
    out = tmp_path / "megatron-ep2"
    convert = ["convert", str(tmp_path / "ckpt" / "step_000010"), "--to", "megatron", "backend.ep=2", *two[:1]]
    proc = bench([*convert, "--out", str(out)], tmp_path)
    assert proc.returncode == 0 and "(match)" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    ep2 = ["backend=megatron", "backend.ep=2", *two, f"run.resume={out}"]
    continued = run_ok([*MOE_COMMON, *ep2], tmp_path / "continued")
    assert continued["resumed_step"] == 10 and len(continued["losses"]) == len(full["losses"]) == STEPS
    for step in range(10, STEPS):
        got, want = continued["losses"][step], full["losses"][step]
        assert abs(got - want) <= 1e-5 * abs(want), (step, continued["losses"][10:], full["losses"][10:])
    assert continued["moe_tokens_per_expert"][10:] == full["moe_tokens_per_expert"][10:]
    for rank in continued["model_state_per_rank"]:
        assert rank["params"] + rank["grads"] + rank["optimizer"] == continued["model_state_expected_bytes"], rank
