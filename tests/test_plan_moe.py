"""bench plan with a Mixture-of-Experts model: expert parallelism in the search, the experts' memory
by hand, the token dispatcher's all-to-all by the communication accounting's own formula, the
refusals of the megatron adapter (docs/moe.md#planner).

moe-tiny (conf/model/moe-tiny.yaml): h = 128, 2 layers, 4 query / 2 key-value heads of d = 32, 4
experts of width FFN = 256, top-2, vocabulary 2,048, untied embeddings.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

from parabench.hydraconfig import compose, to_plain
from parabench.jobs import prepare
from parabench.plan.cluster import load
from parabench.plan.estimate import Calibration, activation_bytes, estimate
from parabench.plan.gemms import forward_gemms
from parabench.plan.search import Searched, _admit, backend_defaults, plannable, search
from parabench.run.comm_report import formula

PROFILES = plannable()  # backend name -> the plan profile its adapter declares

H, FFN, L, E, K, V = 128, 256, 2, 4, 2, 2048
EXPERT = 3 * H * FFN  # w1, w3 (gate, up) and w2 (down) of one expert
DENSE = (
    L * (2 * H + H * H + 2 * 64 * H + H * H + E * H) + H + 2 * V * H
)  # norms, q, k+v, o, router; final norm, embedding, lm_head


def _plain(world: int, *overrides: str, backend: str = "megatron", device: str = "cuda", **options):
    plain = to_plain(
        compose(
            ["+model=moe-tiny", f"backend={backend}", "data.global_batch_size=8", "data.micro_batch_size=2", *overrides]
        )
    )
    cfg = copy.deepcopy(plain)
    cfg["backend"].update(options)
    cfg["launcher"].update(nproc_per_node=world, dry_run=True)
    cfg["device"]["type"] = device
    cfg["tracking"]["enabled"] = False
    return cfg


def _job(world: int, *overrides: str, **options):
    return prepare(_plain(world, *overrides, **options))


def test_dense_parameter_count_of_moe_tiny_by_hand():
    # docs/moe.md measured 1,017,472 parameters on an ep=2 rank: the dense ones and 2 of 4 experts per layer
    assert DENSE + L * 2 * EXPERT == 1_017_472


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_states_per_device_by_hand(ep):
    # fp32, replicated AdamW: 4 param + 4 grad + 8 moments = 16 bytes per parameter held; a rank holds
    # E / ep experts of each layer and every dense parameter (megatron-core expert parallelism)
    st = PROFILES["megatron"].states(_job(4, ep=ep))
    experts = L * (E // ep) * EXPERT
    assert st.expert_elements == experts
    assert st.expert_bytes == 16 * experts
    assert st.total == 16 * (DENSE + experts)
    assert st.elements == DENSE + experts


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_distributed_optimizer_shards_the_experts_over_expert_data_parallel_ranks(ep):
    # bf16 params (2) + fp32 grads (4) of everything held, fp32 main params and the moments (12) of the
    # dense ones over dp = 4 and of the experts over dp / ep ranks (the adapter's formula, measured on 2
    # ranks: tests/test_moe_megatron.py)
    job = _job(4, "run.precision=bf16", ep=ep)
    job = dataclasses.replace(
        job,
        backend=dataclasses.replace(
            job.backend, options=dataclasses.replace(job.backend.options, distributed_optimizer=True)
        ),
    )
    st = PROFILES["megatron"].states(job)
    experts = L * (E // ep) * EXPERT  # both multiples of 128: no padding
    assert DENSE % 128 == 0 and experts % 128 == 0
    assert st.params == 2 * (DENSE + experts) and st.grads == 4 * (DENSE + experts)
    assert st.optimizer == 12 * DENSE / 4 + 12 * experts / (4 // ep)
    assert st.expert_bytes == 6 * experts + 12 * experts / (4 // ep)


def test_moe_block_activations_by_hand():
    # the MoE block replaces the dense MLP's 19 sbh (Korthikanti et al. 2022) by, per token, the router's
    # input (2h) and probabilities (2E), and per routed row (k per token) the dispatched row (2h), the
    # gate and up outputs (4I), SwiGLU's output (2I) and the experts' output (2h): 2-byte activations,
    # x 2 in fp32; one micro-batch in flight without pipelining
    job = _job(4, ep=2)
    dense = dataclasses.replace(job, model=dataclasses.replace(job.model, num_local_experts=0))
    tokens = 2 * 256
    block = tokens * (2 * H + 2 * E + K * (2 * H + 4 * FFN + 2 * FFN + 2 * H))
    want = L * (block - 19 * tokens * H) * 2
    assert activation_bytes(job, "none", True) - activation_bytes(dense, "none", True) == want


def test_expert_gemms_run_the_routed_rows_of_the_ep_ranks():
    # balanced routing: a local expert runs k x tokens x ep / E rows, E / ep of them per layer; the
    # GEMMs' FLOPs are the active parameters' (router + k experts per token) whatever ep
    model = _job(4, ep=2).model
    tokens = 512
    for ep in (1, 2, 4):
        gemms = {g.what: g for g in forward_gemms(model, 256, 2, ep=ep)}
        assert gemms["experts gate+up"].m == tokens * K * ep / E and gemms["experts gate+up"].count == L * E / ep
        assert gemms["router"].n == E
        mlp = sum(g.flops for g in gemms.values() if g.what.startswith(("router", "experts")))
        assert mlp == 2 * tokens * L * (E * H + K * EXPERT)


def test_all_to_all_is_the_comm_accountings_formula_and_exposed():
    cluster = load("h100-sxm")
    job = _job(4, "run.precision=bf16", ep=2)
    e = estimate(job, cluster, 989.0, Calibration())
    a2a = [c for c in e.comm.collectives if c.kind == "all_to_all"]
    got = sum(c.size_bytes * c.calls for c in a2a)
    assert got == formula(job)["all_to_all"]["bytes"]  # bench run's communication accounting
    # by hand: per layer and micro-batch T k rows of h dispatched, combined and both again backward,
    # and T k routing probabilities with the dispatch forward and backward; 2-byte activations
    rows, m = 512 * K, job.grad_accum
    assert got == 4 * m * L * rows * H * 2 + 2 * m * L * rows * 2
    # ep = 2 inside a node: NVLink; megatron-core does not overlap the dispatcher by default
    ep_calls = [c for c in e.comm.collectives if c.group == "ep"]
    link = cluster.intra
    want = sum(c.calls * link.latency_s * (2 - 1) + c.bus_bytes / link.bytes_per_s for c in ep_calls)
    assert e.overlap.total["ep all-to-all"] == pytest.approx(want)
    assert e.overlap.hidden["ep all-to-all"] == 0.0
    no_ep = estimate(_job(4, "run.precision=bf16", ep=1), cluster, 989.0, Calibration())
    assert not [c for c in no_ep.comm.collectives if c.group == "ep"]


def test_all_to_all_crosses_nodes_when_the_ep_group_does():
    one_per_node = dataclasses.replace(load("h100-sxm"), devices_per_node=1)
    e = estimate(_job(4, "run.precision=bf16", ep=2), one_per_node, 989.0, Calibration())
    link = one_per_node.inter
    ep_calls = [c for c in e.comm.collectives if c.group == "ep"]
    want = sum(c.calls * link.latency_s + c.bus_bytes / link.bytes_per_s for c in ep_calls)
    assert e.overlap.total["ep all-to-all"] == pytest.approx(want)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_gradients_reduce_over_the_expert_data_parallel_group(ep):
    # megatron-core reduces the experts' grad buffers over dp / ep ranks, the dense ones over dp
    e = estimate(_job(4, ep=ep), load("h100-sxm"), 67.0, Calibration())
    dp = [c for c in e.comm.collectives if c.group == "dp"]
    edp = [c for c in e.comm.collectives if c.group == "edp"]
    assert [(c.kind, c.group_size, c.size_bytes) for c in dp] == [("all_reduce", 4, 4 * DENSE)]
    want = [("all_reduce", 4 // ep, 4 * L * (E // ep) * EXPERT)] if ep < 4 else []  # one rank: nothing to reduce
    assert [(c.kind, c.group_size, c.size_bytes) for c in edp] == want


def test_the_search_tries_the_expert_parallel_sizes_dp_and_the_experts_allow():
    found = _search("h100-sxm", 4, [2], "data.global_batch_size=8")
    eps = sorted({e.job.backend.options.ep for e in found.ranked + found.unfit if e.job.backend.name == "megatron"})
    assert eps == [1, 2, 4]
    # the distributed optimizer with expert parallelism is searched (the adapter accepts it with MoE)
    assert "backend.distributed_optimizer" not in found.invalid
    assert any(e.job.backend.options.distributed_optimizer and e.job.backend.options.ep == 2 for e in found.ranked)


def _search(cluster_name: str, world: int, mbs: list[int], *overrides: str, model: str = "moe-tiny") -> Searched:
    user = [f"+model={model}", *overrides]
    base = backend_defaults(["megatron"], user)
    return search(base, load(cluster_name), world, mbs, 67.0, Calibration())


@pytest.mark.parametrize(
    ("world", "options", "key"),
    [
        (6, {"ep": 3}, "backend.ep"),  # 3 does not divide the 4 experts
        (4, {"ep": 2, "tp": 2}, "backend.sequence_parallel"),  # megatron-core's MoE layer: tp needs sp
        (4, {"tp": 2, "pp": 2, "sequence_parallel": True}, "backend.tp"),
    ],
)
def test_layouts_the_megatron_adapter_refuses_are_refused(world, options, key):
    out = Searched()
    cfg = _plain(world, "data.global_batch_size=12" if world == 6 else "data.global_batch_size=8", **options)
    est = _admit(out, cfg, [], load("h100-sxm"), 67.0, Calibration(), None)
    assert est is None and out.invalid == {key: 1}, out.refusals


def test_expert_tensor_parallel_is_accepted_but_not_searched_and_gloo_refuses_it_with_expert_parallelism():
    """tp > 1 with sequence parallelism and a MoE model: the adapter accepts it (expert tensor
    parallelism, megatron-core's default expert_tensor_parallel_size = tp), with ep > 1 only where
    nccl gathers the dispatcher's uneven token counts (CUDA), not on a CPU's gloo; the search does not
    try it (its dispatcher's collectives over the tensor ranks are not priced yet)."""
    out = Searched()
    assert _admit(out, _plain(4, ep=2, tp=2, sequence_parallel=True), [], load("h100-sxm"), 67.0, Calibration(), None)
    cpu = _plain(4, device="cpu", ep=2, tp=2, sequence_parallel=True)
    assert _admit(out, cpu, [], load("h100-sxm"), 67.0, Calibration(), None) is None
    assert set(out.invalid) == {"backend.ep"} and "gloo" in out.refusals["backend.ep"], out.refusals
    found = _search("h100-sxm", 4, [2], "data.global_batch_size=8")
    assert found.ranked and all(e.job.backend.options.tp == 1 for e in [*found.ranked, *found.unfit])


def test_mindspeed_stays_refused_with_moe_and_is_not_given_an_ep():
    base = backend_defaults(["mindspeed"], ["+model=moe-tiny", "data.global_batch_size=8"])
    found = search(base, load("ascend-910b"), 4, [2], 67.0, Calibration())
    assert not found.ranked and not found.unfit
    assert set(found.invalid) == {"model.num_local_experts"}


def test_mixtral_on_64_gpus_ranks_expert_parallel_layouts_and_explains_them():
    # 64 x H200 (131 GiB): ep8 holds 1 of 8 experts per layer and fits with replicated fp32 states
    found = _search("h200", 64, [1], "data.global_batch_size=256", model="mixtral-8x7b")
    ep = [e for e in found.ranked if e.job.backend.options.ep > 1]
    assert ep and ep[0].job.backend.options.ep == 8
    from parabench.plan.search import describe, why_wins

    assert "ep8" in describe(ep[0])
    why = why_wins(ep[0], found.ranked[0])
    assert "ep8: 1 of 8 experts per layer" in why and "all-to-all" in why and "inside a node" in why


def test_mixtral_on_64_h100s_fits_expert_parallel_layouts_with_the_distributed_optimizer():
    # 64 x H100 (80 GiB): ep8's replicated fp32 dense states + 1/8 of the experts (114 GiB) miss; the
    # distributed optimizer shards the experts' moments over dp / ep = 8 ranks and the dense ones over
    # 64, and ep8 with it ranks first - with overlap_param_gather, as Megatron-LM's MoE recipes run it
    found = _search(
        "h100-sxm", 64, [1], "data.global_batch_size=256", "backend.overlap_param_gather=true", model="mixtral-8x7b"
    )
    first = found.ranked[0].job.backend.options
    assert (first.ep, first.distributed_optimizer, first.pp) == (8, True, 1)
    # at megatron-core's default (overlap off) each DistributedOptimizer of the chain (dense, experts)
    # gathers every buffer after the step: twice the gathers, and ep8 without it, on pipeline stages
    # (which split the layers' states), ranks first
    default = _search("h100-sxm", 64, [1], "data.global_batch_size=256", model="mixtral-8x7b")
    best = default.ranked[0].job.backend.options
    assert (best.ep, best.distributed_optimizer) == (8, False) and best.pp > 1
    # on one pipeline stage an ep layout fits only with the distributed optimizer (pp > 1 splits the layers)
    one_stage = [e.job.backend.options for e in default.ranked if e.job.backend.options.pp == 1]
    assert all(o.distributed_optimizer for o in one_stage if o.ep > 1)
    replicated = [
        e
        for e in default.unfit
        if e.job.backend.options.ep == 8 and not e.job.backend.options.distributed_optimizer and e.job.parallel.pp == 1
    ]
    from parabench.plan.search import why_lost

    assert replicated and "does not fit by" in why_lost(replicated[0]), [why_lost(e) for e in default.unfit]
