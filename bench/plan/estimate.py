"""Memory and step time of one job on one cluster (docs/plan.md has the model and its sources).

Memory per device: model states (``profiles``: the adapter's published formula split into params,
grads and optimizer states, plus the backend's padding; offloaded states counted as host memory),
activations (Korthikanti et al. 2022, Table 2; docs/sources.md#activation-memory) times the
micro-batches a pipeline stage keeps in flight, communication buffers, and a framework overhead
that comes from a calibration.

Step time: compute on a CUDA or NPU cluster = the step's GEMMs at their shapes' efficiency plus the
memory-bound work (``gemms``: a curve per device kind fitted on published runs), unless a
calibration from recorded runs has an efficiency of the backend; otherwise (the CPU) the harness's
model FLOPs (``flops.flops_per_token``, PaLM) / (peak x calibrated efficiency), x 4/3 with full
recomputation (one more forward); framework = a calibrated
cost per micro-batch (the operators, hooks and copies each forward/backward pass dispatches whatever
its size) x the passes of the whole model a rank makes (``model_passes``; 0 uncalibrated); communication =
``commvolume`` over the cluster's links (alpha-beta), data-parallel communication hidden behind
the backward as far as the backend overlaps it (``profiles``; docs/sources.md#plan-overlap), the
distributed optimizer's parameter gather behind the forward, tensor-parallel collectives behind the
GEMMs where the stack overlaps them (``Features``; else megatron-core's column-parallel backward hides
its asynchronous ones, docs/sources.md#plan-tp-backward-overlap), pipeline send/recv in the interleaved
schedule's steady phase (its warm-up and cool-down block), context parallelism's ring hidden behind
the attention compute, a MoE model's token-dispatch all-to-all (expert parallelism) exposed
(each kept in ``Estimate.overlap``; docs/moe.md#planner); pipeline bubble (p - 1) / (v m) of
compute + framework (docs/sources.md#pipeline-bubble); the last pipeline stage runs the whole output
layer beside its layers (docs/sources.md#plan-output-layer); offload: the host link transfers (hidden like
data-parallel communication, in what the backward has left) and the host optimizer step, exposed
(docs/sources.md#zero-offload).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from parabench.adapters.profile import Offload, Profile, States
from parabench.commvolume import (
    Batch,
    Collective,
    Layout,
    StepComm,
    Widths,
    expert_data_parallel,
    moe_all_to_all,
    repeated_param_gathers,
    step_comm,
    tp_backward_async,
)
from parabench.errors import SpecError
from parabench.flops import flops_per_token
from parabench.plan.cluster import Cluster
from parabench.plan.gemms import (
    CURVES,
    FITTED,
    Curve,
    elementwise_bytes,
    forward_gemms,
    logit_bytes,
    recompute_share,
    stage_compute_s,
)
from parabench.spec import JobSpec

GIB = 1024**3
# uncalibrated share of peak of the FLOPs model (docs/plan.md); CUDA and NPU clusters use the GEMM
# curve (gemms.CURVES) unless a calibration has an efficiency of their own
DEFAULT_EFFICIENCY = {"cpu": 0.5, "cuda": 0.45, "npu": 0.4}
DEFAULT_OVERHEAD = {"cpu": 0.6 * GIB, "cuda": 2.0 * GIB, "npu": 3.0 * GIB}  # runtime + framework, uncalibrated
DEFAULT_UNCERTAINTY = 0.5  # relative width of an uncalibrated step-time prediction (docs/plan.md)


def plan_profile(job: JobSpec) -> Profile:
    """The job's backend as the planner sees it, declared by its adapter (``Adapter.plan_profile``)."""
    profile = job.backend.adapter.plan_profile
    if profile is None:
        raise SpecError("backend", f"backend {job.backend.name} declares no plan profile (Adapter.plan_profile)")
    return profile


@dataclass(frozen=True)
class Calibration:
    """Fitted per ``backend/device kind`` (and finer keys: ``efficiency_keys``); missing keys fall
    back to the defaults above."""

    name: str = "defaults"
    efficiency: dict[str, float] = field(default_factory=dict)
    overhead: dict[str, float] = field(default_factory=dict)
    time_error: float | None = None  # median |predicted - measured| / measured over the fitted runs
    memory_error: float | None = None
    runs: int = 0
    # device kind (all-reduce; p2p uses it too) or kind/collective -> [alpha s per ring step, bytes/s] (bench comm)
    links: dict[str, list[float]] = field(default_factory=dict)
    # seconds of framework work per micro-batch and rank, keyed like ``efficiency`` (absent: 0)
    micro_batch: dict[str, float] = field(default_factory=dict)
    # device kind -> the fitted parameters of its GEMM efficiency curve, [e_max, x0, beta]
    # (``gemms.FITTED``; absent: gemms.CURVES); what is not fitted comes from gemms.CURVES
    curves: dict[str, list[float]] = field(default_factory=dict)

    def curve(self, kind: str) -> Curve:
        if kind not in self.curves:
            return CURVES[kind]
        fitted = dict(zip(FITTED, self.curves[kind]))
        return replace(CURVES[kind], **fitted) if kind in CURVES else Curve(**fitted)

    def eff(self, backend: str, kind: str, threads: int | None = None, layout: str | None = None) -> float:
        """The fitted share of the peak: first for this layout (``layout_key``), for a CPU rank at its
        intra-op thread count (``/tN``: parallel regions synchronise their threads, and the model's
        small GEMMs gain less from a second thread than the large GEMM the peak is measured with),
        then coarser (efficiency_keys)."""
        for key in efficiency_keys(backend, kind, threads, layout):
            if key in self.efficiency:
                return self.efficiency[key]
        return DEFAULT_EFFICIENCY[kind]

    def per_micro_batch(self, backend: str, kind: str, threads: int | None = None, layout: str | None = None) -> float:
        """The fitted framework seconds per micro-batch, looked up like the efficiency (absent: 0).
        A backend with runs of its own never borrows another framework's cost (``*/kind``): where its
        runs could not separate it, its efficiency was fitted with 0 (the one-parameter fit)."""
        own = self.calibrated(backend, kind)
        for key in efficiency_keys(backend, kind, threads, layout):
            if key in self.micro_batch and not (own and key.startswith("*/")):
                return self.micro_batch[key]
        return 0.0

    def over(self, backend: str, kind: str) -> float:
        key = f"{backend}/{kind}"
        return self.overhead.get(key, self.overhead.get(f"*/{kind}", DEFAULT_OVERHEAD[kind]))

    def calibrated(self, backend: str, kind: str) -> bool:
        return f"{backend}/{kind}" in self.efficiency


def efficiency_keys(backend: str, kind: str, threads: int | None, layout: str | None = None) -> list[str]:
    """Calibration keys, most specific first (docs/plan.md#calibration): this backend's layout (at the
    thread count), the backend at the thread count, every backend at it, the backend, every backend."""
    t = f"/t{threads}" if threads else ""
    own = [f"{backend}/{kind}/{layout}{t}"] if layout else []
    coarse = [f"{backend}/{kind}", f"*/{kind}"]
    return [*own, f"{backend}/{kind}{t}", f"*/{kind}{t}", *coarse] if threads else [*own, *coarse]


def layout_key(layout: Layout) -> str:
    """What makes a layout run different framework code: its sharding and model-parallel degrees
    (not dp, whose cost the communication model scales, nor recomputation, counted in the FLOPs)."""
    degrees = (("tp", layout.tp), ("cp", layout.cp), ("pp", layout.pp), ("vpp", layout.vpp))
    parts = [layout.sharding, *(f"{k}{v}" for k, v in degrees if v > 1)]
    return "-".join(parts + (["sp"] if layout.sequence_parallel else []))


@dataclass(frozen=True)
class Features:
    """What a stack does that no harness option sets (a published run's, docs/plan.md#overlap):
    ``tp_overlap``: tensor-parallel collectives overlapped with the GEMMs (Megatron's tp_comm_overlap
    with Transformer Engine on CUDA, MindSpeed's mc2 on the NPU); ``recompute``: replaces the
    layout's (``selective_op``: torchtitan's op-level selective activation checkpointing); ``ops``: the
    memory-bound ops run fused or eager (``gemms.LAYER_BYTES``)."""

    tp_overlap: bool = False
    recompute: str | None = None
    # the memory-bound ops' kernels (``gemms.LAYER_BYTES``): fused | eager (torchtitan without torch.compile)
    ops: str = "fused"


@dataclass(frozen=True)
class Overlap:
    """Each mechanism's communication in a step and the part of it hidden behind compute (s)."""

    total: dict[str, float] = field(default_factory=dict)
    hidden: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        return ", ".join(
            f"{k} {1e3 * self.hidden.get(k, 0.0):.3g}/{1e3 * v:.3g} ms hidden" for k, v in self.total.items() if v
        )


@dataclass(frozen=True)
class Estimate:
    job: JobSpec
    states: States
    activations: float
    buffers: float
    overhead: float
    device_bytes: float
    host_bytes: float
    memory_bytes: float  # the device's memory
    compute_s: float
    comm_s: float  # all communication, before overlap
    exposed_comm_s: float
    bubble_s: float
    step_s: float
    tokens_per_s_per_device: float
    mfu: float | None
    comm: StepComm
    offload_s: float = 0.0  # exposed: host optimizer step + host link transfers not hidden
    transfer_s: float = 0.0  # host link transfers, before overlap
    host_step_s: float = 0.0  # the optimizer step on the host
    cp_hidden_s: float = 0.0  # context-parallel ring hidden behind the attention compute
    host_capacity_bytes: float = float("inf")  # this device's share of its node's host memory
    framework_s: float = 0.0  # calibrated framework cost per micro-batch x model_passes
    overlap: Overlap = field(default_factory=Overlap)  # per mechanism: communication and what is hidden
    compute_model: str = "flops"  # flops (one efficiency) | gemm-shapes (the device kind's curve)
    # compute of a pipeline stage before the last (its layers only: the output layer is the last
    # stage's, in compute_s); what the bubble's idle slots last
    stage_compute_s: float = 0.0

    @property
    def margin_bytes(self) -> float:
        return self.memory_bytes - self.device_bytes

    @property
    def host_margin_bytes(self) -> float:
        return self.host_capacity_bytes - self.host_bytes

    @property
    def shortfall_bytes(self) -> float:
        """How far the candidate misses: the larger overshoot of device and host memory (<= 0: fits)."""
        return max(-self.margin_bytes, -self.host_margin_bytes)

    @property
    def fits(self) -> bool:
        return self.shortfall_bytes <= 0

    @property
    def comm_share(self) -> float:
        return self.exposed_comm_s / self.step_s

    @property
    def bubble_share(self) -> float:
        return self.bubble_s / self.step_s


def activation_bytes(
    job: JobSpec, recompute: str, fused_attention: bool = False, vocab_parallel: bool = True, recomputed: float = 1.0
) -> float:
    """Activations a device holds at its peak (Korthikanti et al. 2022, Table 2, for 2-byte
    activations; fp32 doubles them) on the pipeline stage that holds the most: the first stage's
    micro-batches in flight, or the last stage's with the fp32 logits and their gradient (split over
    tp when lm_head is: ``vocab_parallel``; ``stages_in_flight``).
    ``recompute``: none | selective | full (docs/sources.md#activation-memory) | selective_op
    (``op_sac_layer_bytes``); ``recomputed``: the
    share of the layers full recompute covers (the others keep all their activations)."""
    m, d, o = job.model, job.data, job.backend.options
    s, b, h, a = d.seq_len, d.micro_batch_size, m.hidden_size, m.num_attention_heads
    t, p = getattr(o, "tp", 1), getattr(o, "pp", 1)
    v, sp = getattr(o, "vpp", 1), getattr(o, "sequence_parallel", False)
    s //= getattr(o, "cp", 1)
    # selective recomputation (Korthikanti et al. 2022, section 5) recomputes the attention scores,
    # softmax and dropout: their 5as/h term drops, as with a fused attention kernel
    attn = 0.0 if fused_attention or recompute == "selective" else 5 * a * s / (h * t)
    per_layer = s * b * h * ((34 / t if sp else 10 + 24 / t) + attn) if t > 1 else s * b * h * (34 + attn)
    if m.is_moe:  # the MoE block's activations replace the dense MLP's 19 sbh (docs/moe.md#planner)
        per_layer += moe_block_bytes(job) - s * b * h * ((19 / t if sp else 3 + 16 / t) if t > 1 else 19)
    width = (4 if job.run.precision == "fp32" else 2) / 2
    layers = m.num_hidden_layers / p
    if recompute == "full":  # layer inputs kept; one layer's activations live during its recompute
        stored = 2 * s * b * h * layers * recomputed + per_layer * (layers * (1 - recomputed) + 1)
    elif recompute == "selective_op":  # the saved op outputs; one layer's activations during its recompute
        stored = op_sac_layer_bytes(job) * layers + per_layer
    else:
        stored = per_layer * layers
    first, last = stages_in_flight(p, v, job.grad_accum)
    logits = 2 * s * b * m.vocab_size / (t if vocab_parallel else 1) * 4
    # a device is one pipeline stage: the first holds the most micro-batches, the last the logits
    return max(stored * width * first, stored * width * last + logits)


def op_sac_layer_bytes(job: JobSpec) -> float:
    """Activations one decoder layer keeps for the backward of a micro-batch under torchtitan's op-level
    selective activation checkpointing (2-byte activations): the block's input (``checkpoint_wrapper``
    keeps it) and what the policy saves - the output of every mm but every second one, and the
    attention's (pytorch/torchtitan 9dec370 torchtitan/parallelisms/parallelize_llama.py ``_save_list``,
    ``_custom_policy``: ``mm_count % 2 == 0`` recomputed). A Llama block calls its mms in the order
    q, k, v, o, w1, w3, w2 (torchtitan/models/llama/model.py), so q (q), v (kv), w1 (i) and w2 (h) are
    saved, with the attention output (q); everything else is recomputed. tp splits all but the
    block's input and w2's output (FSDP2 + TP without sequence parallelism)."""
    m, d, o = job.model, job.data, job.backend.options
    t = getattr(o, "tp", 1)
    tokens = d.seq_len // getattr(o, "cp", 1) * d.micro_batch_size
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    return 2 * tokens * (2 * m.hidden_size + (2 * q + kv + m.intermediate_size) / t)


def stages_in_flight(p: int, v: int, micro_batches: int) -> tuple[float, float]:
    """Micro-batches whose activations the first and the last pipeline stage hold at their peak (in
    stage-sized units; a model chunk is 1 / v of a stage). 1F1B (megatron-core 0.16 schedules.py
    ``forward_backward_pipelining_without_interleaving``): rank r runs p - r - 1 warm-up forwards
    before its first backward, so the first stage holds min(p, m) and the last one. Interleaved
    (``forward_backward_pipelining_with_interleaving``): rank r runs (p - r - 1) x 2 + (v - 1) x p
    warm-up chunk-steps, at most m v; the first stage holds (1 + (p - 1) / (p v)) x p micro-batches
    (Korthikanti et al. 2022 sec. 4.2.3), the last ((v - 1) p + 1) / v."""
    if v <= 1:
        return float(min(p, micro_batches)), float(min(1, micro_batches))
    first = min(p, micro_batches) * (1 + (p - 1) / (p * v))
    return first, min((v - 1) * p + 1, micro_batches * v) / v


def moe_block_bytes(job: JobSpec) -> float:
    """Activations one MoE block stores for the backward of a micro-batch (2-byte activations), by
    Korthikanti et al.'s accounting (each GEMM's input, the activation function's input) applied to
    megatron-core's ``MoELayer``: the router's input (2 T h) and its probabilities (2 T E); for each
    of the k T routed rows (balanced routing: the rows a device's experts receive equal those it
    sends), the dispatched row (2 h, fc1's input), fc1's gate and up outputs (4 I, SwiGLU's input),
    SwiGLU's output (2 I, fc2's input) and fc2's output (2 h, kept for the probability-weighted
    combine's backward); the expert width over the expert tensor-parallel size (tp). A shared expert
    runs every token as a dense SwiGLU MLP: 2 h + 6 S per token. T = s b / cp tokens."""
    m, d, o = job.model, job.data, job.backend.options
    t = getattr(o, "tp", 1)
    tokens = d.seq_len // getattr(o, "cp", 1) * d.micro_batch_size
    h, i, k = m.hidden_size, m.expert_intermediate_size, m.num_experts_per_tok
    routed = k * (4 * h + 6 * i / t)
    shared = 2 * h + 6 * m.shared_expert_intermediate_size / t if m.shared_expert_intermediate_size else 0.0
    return tokens * (2 * h + 2 * m.num_local_experts + routed + shared)


def model_passes(job: JobSpec) -> float:
    """Forward/backward passes of the whole model one rank makes per step, what the per-micro-batch
    framework cost scales with: the micro-batches x the share of the layers its pipeline stage runs
    (a stage dispatches the operators of its L / p layers per micro-batch)."""
    return job.grad_accum / getattr(job.backend.options, "pp", 1)


def threads_of(cluster: Cluster) -> int | None:
    """Intra-op threads of a rank the plan assumes: the cluster file's (CPU only)."""
    return int((cluster.measured or {}).get("threads_per_rank", 1)) if cluster.device_kind == "cpu" else None


def estimate(
    job: JobSpec,
    cluster: Cluster,
    peak_tflops: float | None,
    cal: Calibration,
    threads: int | None = None,
    features: Features | None = None,
) -> Estimate:
    """``threads``: a recorded CPU run's threads per rank (default: the cluster's); ``features``:
    what the stack does beyond the harness's options (published runs; default none)."""
    prof = plan_profile(job)
    features = features or Features()
    states = prof.states(job)
    recompute = features.recompute or prof.recompute(job)
    recomputed = 1.0 if features.recompute else prof.recomputed_layers(job)
    kind, layout = cluster.device_kind, prof.layout(job)
    acts = activation_bytes(
        job, recompute, prof.fused_attention(job),
        layout.vocab_parallel, recomputed,
    )  # fmt: skip
    buffers = prof.buffers(job)
    overhead = cal.over(job.backend.name, cluster.device_kind)
    # without a host link (the CPU cluster) "offloaded" states stay in the same memory as the rest
    host = states.host if cluster.host_link else 0.0
    device = states.total - host + acts + buffers + overhead
    fpt = flops_per_token(job.model, job.data.seq_len)
    threads = (threads or threads_of(cluster)) if kind == "cpu" else None
    compute, stage, compute_model = _compute_s(
        job, layout, cluster, peak_tflops, cal, threads, recompute, recomputed, features.ops
    )
    framework = cal.per_micro_batch(job.backend.name, kind, threads, layout_key(layout)) * model_passes(job)
    comm, spans, times, gather = _step_comm_s(job, prof, layout, cluster, cal, states)
    column = _tp_backward_async(job, prof, layout, cluster, cal, spans["tp"], stage)
    fused = _fused_tp_gemms_s(job, layout, cluster, peak_tflops, cal) if features.tp_overlap else None
    gemm_share = 6 * job.model.num_active_matmul_params() / fpt
    overlap = _overlap(job, prof, times, gather, compute, features, gemm_share, column, fused)
    dp_hidden = overlap.hidden["dp grad reduce"] + overlap.hidden["dp param gather"]
    exposed = sum(times.values()) - sum(overlap.hidden.values())
    transfer, host_step, offload = _offload_time(
        prof.offload(job, states), cluster, min(job.parallel.world_size, cluster.devices_per_node),
        max(compute * 2 / 3 - dp_hidden, 0.0),
    )  # fmt: skip
    o = job.backend.options
    p, v = getattr(o, "pp", 1), getattr(o, "vpp", 1)
    # the idle slots of the pipeline last as long as a micro-batch's compute and framework work on
    # the stages the warm-up and cool-down pass through (all but the last, which holds the output layer)
    bubble = (stage + framework) * (p - 1) / (v * job.grad_accum)
    step = compute + framework + bubble + exposed + offload
    per_device = job.tokens_per_step / step / job.parallel.world_size
    mfu = per_device * fpt / (peak_tflops * 1e12) if peak_tflops else None
    return Estimate(
        job, states, acts, buffers, overhead, device, host, cluster.memory_bytes,
        compute, sum(times.values()), exposed, bubble, step, per_device, mfu, comm,
        offload, transfer, host_step, overlap.hidden["cp ring"],
        cluster.host_memory_bytes / min(job.parallel.world_size, cluster.devices_per_node), framework,
        overlap, compute_model, stage,
    )  # fmt: skip


def _step_comm_s(
    job: JobSpec, prof, layout: Layout, cluster: Cluster, cal: Calibration, states: States
) -> tuple[StepComm, dict, dict[str, float], float]:
    """A step's collectives (commvolume.step_comm; a MoE model's experts synchronised over the
    expert-data-parallel group and its token dispatch: ``_expert_comm``), the devices each parallel
    group spans, each group's seconds on its link, and the data-parallel all-gathers' seconds (ZeRO-3 /
    FSDP params, the distributed optimizer's gather, the experts' included)."""
    batch = Batch(job.data.seq_len, job.data.micro_batch_size, job.grad_accum)
    dense = step_comm(
        job.model,
        layout,
        batch,
        prof.widths(job),
        dp_elements=states.elements - states.expert_elements,
        root_elements=prof.root_elements(job),
    )
    collectives = dense.collectives + tuple(_expert_comm(job, layout, batch, prof.widths(job), states))
    comm = StepComm(tuple(repeated_param_gathers(collectives, prof.param_gathers(job))))
    spans = _spans(job)
    seconds = {id(c): c.seconds(*_link(cluster, spans[c.group], cal, c.kind)) for c in comm.collectives}
    times = {g: sum(seconds[id(c)] for c in comm.collectives if c.group == g) for g in spans}
    # a pipeline rank's send and receive of one schedule step go out in one call and are waited
    # together (megatron-core 0.16 p2p_communication.py ``P2PCommunicator._communicate``: one
    # batch_isend_irecv, or isend/irecv pairs, then wait on all): the 1F1B steady state's
    # send_forward_recv_backward and the interleaved warm-up's send_forward_recv_forward move both
    # tensors at once over a full-duplex link, so the step spends the longer of the two, not their sum
    times["pp"] = max(
        sum(seconds[id(c)] for c in comm.collectives if c.group == "pp" and c.kind == kind) for kind in ("send", "recv")
    )
    gather = sum(seconds[id(c)] for c in comm.collectives if c.group in ("dp", "edp") and c.kind == "all_gather")
    return comm, spans, times, gather


def _expert_comm(job: JobSpec, layout: Layout, batch: Batch, widths: Widths, states: States) -> list[Collective]:
    """A MoE model's collectives beyond the dense ones: its experts' gradient reduction (and
    distributed-optimizer gather) over the expert-data-parallel group where the backend keeps them apart
    (``States.expert_elements``: megatron), and with expert parallelism the all-to-all token dispatcher's
    dispatch and combine, forward and backward, by the communication accounting's own formula
    (``commvolume.moe_all_to_all``; megatron-core's ``alltoall`` dispatcher, the default; the
    ``allgather`` dispatcher has no formula here and is not priced)."""
    out = []
    if states.expert_elements:
        out += expert_data_parallel(job.model, layout, batch, widths, states.expert_elements)
    if getattr(job.backend.options, "moe_token_dispatcher", None) == "alltoall":
        out += moe_all_to_all(job.model, batch, widths, layout.ep, tp=layout.tp, pp=layout.pp, cp=layout.cp)
    return out


def _compute_s(
    job: JobSpec, layout: Layout, cluster: Cluster, peak_tflops: float | None, cal: Calibration,
    threads: int | None, recompute: str, recomputed: float = 1.0, ops: str = "fused",
) -> tuple[float, float, str]:  # fmt: skip
    """(seconds of compute per step of the last pipeline stage, of any other stage, the model used).
    A device kind with a GEMM efficiency curve (``gemms.CURVES``) and no efficiency of its own from
    recorded runs: the step's GEMMs at their shapes' efficiency (docs/plan.md#compute-from-gemm-shapes);
    otherwise (the CPU) the model FLOPs at one calibrated efficiency. Full recomputation runs the
    recomputed layers' forward once more (3 -> 4 forward passes: Narayanan et al. 2021, Eq. 3,
    docs/sources.md#megatron-activation-recompute), selective the attention core's (QK^T and x V:
    PaLM's attention term's forward third). The output layer runs whole on the last stage
    (docs/sources.md#plan-output-layer): the stages before it run 1 / pp of the layers only."""
    if not peak_tflops:
        return float("nan"), float("nan"), "flops"
    kind, name = cluster.device_kind, job.backend.name
    if kind in CURVES and not cal.calibrated(name, kind):
        shape = (job.model, job.data.seq_len, job.data.micro_batch_size, layout.tp, layout.cp, layout.vocab_parallel)
        share = recompute_share(job.model, recompute) * recomputed
        logits = logit_bytes(*shape)
        last, other = stage_compute_s(
            forward_gemms(*shape, ep=layout.ep), job.grad_accum, layout.pp, peak_tflops * 1e12, cal.curve(kind), share,
            elementwise_bytes(*shape, ops=ops) - logits, attention_recompute=float(recompute == "selective"),
            output_bytes=logits,
        )  # fmt: skip
        return last, other, "gemm-shapes"
    fpt = flops_per_token(job.model, job.data.seq_len)
    flops = fpt * job.tokens_per_step / job.parallel.world_size
    if recompute == "full":
        flops *= 1 + recomputed / 3
    if recompute == "selective":  # PaLM's 12 L H Q T is forward + backward: the forward is a third
        m = job.model
        flops += (
            4
            * m.num_hidden_layers
            * m.num_attention_heads
            * m.head_dim
            * job.data.seq_len
            * (job.tokens_per_step / job.parallel.world_size)
        )
    # the lm_head's forward and backward (6 V h per token, over tp with the rest): 1 / pp of it is in
    # the FLOPs above, the last stage runs all of it, the others none
    head = 6 * job.model.vocab_size * job.model.hidden_size * job.tokens_per_step / job.parallel.world_size
    seconds = 1 / (peak_tflops * 1e12 * cal.eff(name, kind, threads, layout_key(layout)))
    return (flops + head * (layout.pp - 1)) * seconds, (flops - head) * seconds, "flops"


def _tp_backward_async(job: JobSpec, prof, layout: Layout, cluster: Cluster, cal: Calibration, span: int,
                       stage: float) -> tuple[float, float, float]:  # fmt: skip
    """(seconds of the column-parallel backward's asynchronous re-gathers, of its input-gradient
    reductions, of one backward GEMM of those linears per step) where the backend overlaps them
    (``Profile.tp_backward_overlap``; docs/sources.md#plan-tp-backward-overlap), else zeros. A
    backward GEMM (dgrad or wgrad) of a linear has its forward's FLOPs: 2 x its parameters per token,
    the share 2 (qkv + gate+up parameters) / the layers' FLOPs per token of a stage's compute."""
    if not prof.tp_backward_overlap(job) or layout.tp <= 1:
        return 0.0, 0.0, 0.0
    m = job.model
    batch = Batch(job.data.seq_len, job.data.micro_batch_size, job.grad_accum)
    calls = tp_backward_async(m, layout, batch, prof.widths(job))
    secs = {c.kind: c.seconds(*_link(cluster, span, cal, c.kind)) for c in calls}
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    column = m.num_hidden_layers * m.hidden_size * (q + 2 * kv + 2 * m.intermediate_size)
    layers_fpt = flops_per_token(m, job.data.seq_len) - 6 * m.vocab_size * m.hidden_size
    return (
        secs.get("all_gather", 0.0),
        sum(secs.values()) - secs.get("all_gather", 0.0),
        stage * 2 * column / layers_fpt,
    )


def _overlap(
    job: JobSpec, prof, times: dict[str, float], gather: float, compute: float, features: Features, gemm_share: float,
    column: tuple[float, float, float] = (0.0, 0.0, 0.0), fused: dict[str, float] | None = None,
) -> Overlap:  # fmt: skip
    """What each mechanism hides (docs/sources.md#plan-overlap): the dp gradient reduction behind the
    backward (2/3 of the compute) as far as the backend overlaps it; with ``overlap_param_gather``
    the distributed optimizer's parameter all-gather behind the forward (1/3); the context-parallel
    ring behind the attention (the 12 L H Q T share of the FLOPs: PaLM); tensor-parallel
    collectives where the stack overlaps them (``Features.tp_overlap``) each behind the one GEMM it
    is fused with (``fused_tp_hidden``; the CPU's FLOPs model: behind all the GEMMs), else the
    column-parallel backward's asynchronous ones (``column``: re-gathers behind the input-gradient
    GEMMs, reductions behind the weight-gradient GEMMs, each at most those GEMMs' time); the share of
    the pipeline send/recv the schedule overlaps (the profile's ``pp_overlap``: the interleaved
    schedule's steady phase, not its warm-up and cool-down); a MoE model's expert-data-parallel
    collectives as the dp ones; none of the MoE token dispatcher's all-to-all (megatron-core 0.16
    overlaps it only with ``overlap_moe_expert_parallel_comm``, off by default: docs/moe.md#planner)."""
    param = prof.param_overlap(job) * min(gather, compute / 3)
    data = times["dp"] + times["edp"]  # the experts' buffers reduce and gather as the dense ones do
    grad_part = data - (gather if prof.param_overlap(job) else 0.0)
    regather, reduce, gemm = column
    column_async = min(regather, gemm) + min(reduce, gemm)
    if features.tp_overlap and fused:  # never less than the asynchronous column backward it replaces
        sp = bool(getattr(job.backend.options, "sequence_parallel", False))
        tp = max(fused_tp_hidden(times["tp"], fused, sp), column_async)
    elif features.tp_overlap:
        tp = min(times["tp"], compute * gemm_share)
    else:
        tp = column_async
    hidden = {
        "dp grad reduce": prof.overlap(job) * min(grad_part, compute * 2 / 3),
        "dp param gather": param,
        "tp": tp,
        "cp ring": min(times["cp"], compute * (1 - gemm_share)),
        "pp send/recv": min(prof.pp_overlap(job) * times["pp"], compute),
        "ep all-to-all": 0.0,
    }
    total = {"dp grad reduce": grad_part, "dp param gather": data - grad_part, "tp": times["tp"],
             "cp ring": times["cp"], "pp send/recv": times["pp"], "ep all-to-all": times["ep"]}  # fmt: skip
    return Overlap(total, hidden)


# the collectives of a layer each GEMM runs one of inside its own (forward, input-gradient or
# weight-gradient) GEMM when tensor-parallel communication is fused: with sequence parallelism the
# column-parallel qkv and gate+up all-gather their input (forward), re-gather it (behind the
# input-gradient GEMM) and reduce-scatter their input gradient (behind the weight-gradient GEMM); the
# row-parallel o and down reduce-scatter their output (forward) and all-gather its gradient (behind
# the input-gradient GEMM): 10 per layer, as ``commvolume`` counts them. Without it, 4 all-reduces:
# o's and down's in the forward, qkv's and gate+up's input gradients in the backward.
FUSED_TP_GEMMS = {True: {"qkv": 3, "o": 2, "gate+up": 3, "down": 2}, False: {"qkv": 1, "o": 1, "gate+up": 1, "down": 1}}


def fused_tp_hidden(tp_s: float, gemm_s: dict[str, float], sequence_parallel: bool = True) -> float:
    """The tensor-parallel communication fused GEMM + collective kernels hide: each collective only
    behind the one GEMM it runs in - MindSpeed's mc2 (``--use-mc2``: torch_npu's npu_all_gather_base_mm /
    npu_mm_reduce_scatter_base, Ascend/MindSpeed mindspeed/core/tensor_parallel/ascend_turbo/
    mc2_linears_seq_parallel.py; its own planner prices an mc2 kernel as the matmul's time plus an
    exposed communication time, mindspeed/auto_settings/module/communication/mc2_comm_perf_predictor.py),
    Transformer Engine's userbuffers (``--tp-comm-overlap``: an all-gather split into the chunks of the
    GEMM that consumes it, a reduce-scatter into those of the GEMM that produces it, the backward's
    "bulk" overlaps). The collectives move equal tensors (b s h): ``tp_s`` spread evenly over the
    ``FUSED_TP_GEMMS`` slots, each hidden up to its GEMM's time (``gemm_s``: one forward pass of each
    kind per step, s; a backward GEMM has its forward's FLOPs)."""
    slots = FUSED_TP_GEMMS[sequence_parallel]
    each = tp_s / sum(slots.values())
    return sum(n * min(each, gemm_s.get(what, 0.0)) for what, n in slots.items())


def _fused_tp_gemms_s(
    job: JobSpec, layout: Layout, cluster: Cluster, peak_tflops: float | None, cal: Calibration
) -> dict[str, float] | None:
    """Seconds of one forward pass per step of each GEMM of the last stage (its 1 / pp of the layers, every
    micro-batch) at its shape's efficiency (``gemms``); None without the GEMM model (the CPU)."""
    kind = cluster.device_kind
    if not peak_tflops or kind not in CURVES or cal.calibrated(job.backend.name, kind):
        return None
    shape = (job.model, job.data.seq_len, job.data.micro_batch_size, layout.tp, layout.cp, layout.vocab_parallel)
    curve, per_stage = cal.curve(kind), job.grad_accum / layout.pp
    return {
        g.what: g.flops / (peak_tflops * 1e12 * curve.eff(g.m, g.n, g.k)) * per_stage
        for g in forward_gemms(*shape, ep=layout.ep)
        if g.what in FUSED_TP_GEMMS[True]
    }


def _offload_time(off: Offload, cluster: Cluster, ranks_per_node: int, backward_left: float) -> tuple[float, ...]:
    """(host link transfers, host optimizer step, exposed offload time) of one step: the transfers at
    the host link's bandwidth, hidden as far as the backend overlaps them within what the backward
    has left after the data-parallel communication; the host step is memory-bound (every state read
    and written once) on the node's host memory, which the node's ranks share, and exposed (no
    delayed parameter update). No host link: nothing crosses one."""
    link = cluster.host_link
    if link is None or not (off.transfer_bytes or off.host_elements):
        return 0.0, 0.0, 0.0
    transfer = off.transfer_bytes / link.bytes_per_s
    host_step = off.host_elements * off.host_pass_bytes * ranks_per_node / link.memory_bytes_per_s
    return transfer, host_step, host_step + transfer - off.overlap * min(transfer, backward_left)


def _spans(job: JobSpec) -> dict[str, int]:
    """Consecutive devices each group spans (Megatron's rank order: tp fastest, then cp, dp, pp). The
    expert groups follow megatron-core's expert rank generator (``parallel_state.py``, order
    tp-ep-dp-pp at expert tp = tp, no cp): an ep group spans tp x ep devices, so it stays inside a node
    while tp x ep does; the expert-data-parallel group the rest of a pipeline stage."""
    par = job.parallel
    ep = getattr(job.backend.options, "ep", 1)
    dp = par.tp * par.cp * par.dp
    return {"tp": par.tp, "cp": par.tp * par.cp, "dp": dp, "pp": par.world_size, "ep": par.tp * ep, "edp": dp}


def _link(cluster: Cluster, span: int, cal: Calibration, op: str = "all_reduce") -> tuple[float, float]:
    """(latency, bandwidth) of the link a group runs over: a bench comm fit for this device kind
    replaces the cluster file's intra-node figures; the fit of this collective kind where bench comm
    measured it (all-gather and reduce-scatter run other algorithms than the all-reduce: gloo has no
    native reduce-scatter), else the all-reduce's."""
    link = cluster.link(span)
    fitted = cal.links.get(f"{cluster.device_kind}/{op}", cal.links.get(cluster.device_kind))
    if fitted and link is cluster.intra:
        return fitted[0], fitted[1]
    return link.latency_s, link.bytes_per_s


def gpt_parameters(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Parameters of a GPT model (4h MLP, learned positions, biases) by Narayanan et al. 2021, Eq. 2:
    P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)) (docs/sources.md#megatron-parameter-count).
    A cross-check of the published scale of a layout, not of the canonical Llama (which counts
    its own parameters exactly: ``ModelSpec.num_params``)."""
    return 12 * layers * hidden**2 * (1 + 13 / (12 * hidden) + (vocab + seq_len) / (12 * layers * hidden))
