"""Compute time of a step from the shapes of its GEMMs (docs/plan.md#compute-from-gemm-shapes).

Every matrix multiply of a Llama forward pass, per device after the tensor- and context-parallel
splits (Megatron's column/row-parallel linears split the output or the input dimension by tp,
Narayanan et al. 2021 sec. 2.3; context parallelism gives a rank s / cp query tokens against all s
keys, Liu et al. 2023), as (m, n, k): m tokens of the micro-batch, an n x k weight. Their FLOPs
summed are exactly PaLM's 6N + 12 L H Q T per token (Chowdhery et al. 2022, App. B;
docs/sources.md#plan-gemm-shapes): the backward runs two GEMMs of the same shape per forward GEMM.

Each GEMM runs at a share of the device's peak that grows with its arithmetic intensity
x = mnk / (mk + kn + mn) (FLOPs per byte moved for 2-byte operands: the roofline model, Williams,
Waterman and Patterson 2009): eff(x) = e_max x / (x + x0). Beside the GEMMs, the memory-bound work
(norms, activation functions, rotary embedding, the logits' softmax and cross-entropy) costs beta
seconds per byte it moves, counted per op from the kernels the stack runs (``LAYER_BYTES``: fused, or
eager PyTorch; ``LOGIT_BYTES``), tokens x (L x layer bytes + 52 V) / tp. e_max, x0 and beta are fitted once
per device kind on published runs (benchmarks/plan_published.py --fit; the values and the rows they were fitted on
are in ``CURVES`` and docs/plan.md). The fused attention kernel (FlashAttention, Dao 2023) runs its
GEMMs at e_max on a GPU (at their per-head shape's intensity on the Ascend 910B, whose cube and vector
cores pass the score tiles through global memory: docs/sources.md#plan-attention-npu), recomputes the scores in its backward (5 GEMMs there against 2 in the forward: 2.5 x
the forward FLOPs, FlashAttention-2 sec. 4.1) and evaluates one exponential per score in the forward
and one more in the backward's recomputation, on the special-function units, whose throughput is a
device's ``sfu_ratio`` below its matmul peak (H100: 989 against 3.9 TFLOP/s, FlashAttention-3 sec. 1):
per score a head of dimension d does 4 d matmul FLOPs in the forward, so the exponentials cost
sfu_ratio / 4d of the matmul time at peak - half at d 128, all of it at d 64
(docs/sources.md#plan-attention-softmax).
"""

from __future__ import annotations

from dataclasses import dataclass

from parabench.spec import ModelSpec

FITTED = ("e_max", "x0", "beta")  # a curve's parameters fitted on published runs


@dataclass(frozen=True)
class Curve:
    """Share of the peak a GEMM reaches at arithmetic intensity x: e_max x / (x + x0)."""

    e_max: float
    x0: float
    # seconds per byte of the memory-bound work beside the GEMMs (norms, activations, rotary
    # embedding, the logits' softmax and cross-entropy; 1 / beta: the bandwidth it achieves): per
    # token ``layer_bytes`` x L of the layers and ``LOGIT_BYTES`` x V of the logits, split by tp
    # (sequence parallelism) and pp
    beta: float = 0.0
    # matmul peak FLOP/s per exponential/s of the special-function units (the attention's softmax),
    # published, not fitted (0: not modelled); FlashAttention-2 runs the softmax between its two
    # GEMMs in the same warps, so its time adds to theirs (docs/sources.md#plan-attention-softmax)
    sfu_ratio: float = 0.0
    # the fused attention's score tiles pass through global memory between its GEMMs and its softmax
    # (the Ascend 910B's separated cube and vector cores: docs/sources.md#plan-attention-npu): its two
    # GEMMs run at their per-head shape's intensity (about the head dimension), not at e_max
    attention_at_shape: bool = False
    fitted_on: str = ""  # which published rows (benchmarks/data/published_runs.yaml)

    def eff(self, m: float, n: float, k: float) -> float:
        x = intensity(m, n, k)
        return self.e_max * x / (x + self.x0)


# H100 SXM: 4,096 dense bf16 tensor FLOPs (132 SMs x 1,830 MHz: 989 TFLOP/s) against 16 exponentials
# per SM and clock (CUDA C++ Programming Guide, arithmetic instruction throughput, compute capability
# 9.0): 256, FlashAttention-3's 989 against 3.9 TFLOP/s (docs/sources.md#plan-attention-softmax)
H100_SFU_RATIO = 4096 / 16

# e_max, x0, beta fitted by `benchmarks/plan_published.py --fit` (docs/plan.md#calibration-on-published-runs);
# refitted 2026-12-07 with the memory-bound work in bytes (beta: seconds per byte, ``LAYER_BYTES``,
# ``LOGIT_BYTES``) and fused tensor-parallel collectives hidden per GEMM (estimate.fused_tp_hidden)
CURVES: dict[str, Curve] = {
    "cuda": Curve(0.52, 118.9, 7e-13, H100_SFU_RATIO,
                  fitted_on="megatron-readme (9 rows) + torchtitan-h100-202412 (2 rows), H100"),
    # the 910B's exponential throughput is not published: no softmax term (docs/plan.md: a fitted one
    # helped the rows it was fitted on and worsened the held-out figure); its attention GEMMs at their
    # per-head shape (``_eff``), refitted 2026-12-07 22:30 UTC
    "npu": Curve(0.58, 100.0, 1e-12, attention_at_shape=True,
                 fitted_on="mindspeed-llm-readme (28 expressible rows), Ascend 910B"),
}  # fmt: skip


def intensity(m: float, n: float, k: float) -> float:
    """FLOPs per byte of a GEMM of 2-byte operands: 2mnk / (2 (mk + kn + mn))."""
    return m * n * k / (m * k + k * n + m * n)


@dataclass(frozen=True)
class Gemm:
    what: str
    m: float
    n: float
    k: float
    count: float  # how many per forward pass of one micro-batch over the whole model
    heads: float = 0.0  # attention heads of the device a batched GEMM runs (the attention scores)
    head_dim: float = 0.0  # the attention's GEMMs: the dimension of one head (their per-head shape)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    @property
    def scores(self) -> float:
        """Attention scores the GEMM computes per forward pass, one exponential each (softmax)."""
        return self.m * self.n * self.heads * self.count


def forward_gemms(
    model: ModelSpec, seq_len: int, micro_batch: int, tp: int = 1, cp: int = 1, vocab_parallel: bool = True,
    ep: int = 1,
) -> list[Gemm]:  # fmt: skip
    """The forward GEMMs of one micro-batch on one device (all layers; a pipeline stage runs 1 / pp
    of them). The attention scores and their product with V are one batched GEMM each over the
    device's heads: (s / cp) x s x head_dim per head, of which a causal kernel computes half (FlashAttention
    skips the blocks above the diagonal, Dao 2023; Megatron's context-parallel ring balances them over
    the cp ranks): ``count`` = L / 2. (MFU still counts PaLM's full 12 L H Q T.) ``vocab_parallel``
    false: lm_head whole on every tp rank (FSDP2 + TP splits the decoder layers only). A MoE model's
    MLP is ``moe_gemms`` (``ep``: its expert-parallel size)."""
    h, i, layers = model.hidden_size, model.intermediate_size, model.num_hidden_layers
    q = model.num_attention_heads * model.head_dim
    kv = model.num_key_value_heads * model.head_dim
    m = micro_batch * seq_len / cp
    mlp = moe_gemms(model, m, tp, ep) if model.is_moe else [
        Gemm("gate+up", m, 2 * i / tp, h, layers),
        Gemm("down", m, h, i / tp, layers),
    ]  # fmt: skip
    return [
        Gemm("qkv", m, (q + 2 * kv) / tp, h, layers),
        Gemm("attention scores", m, seq_len, q / tp, layers / 2, model.num_attention_heads / tp, model.head_dim),
        Gemm("attention x V", m, q / tp, seq_len, layers / 2, head_dim=model.head_dim),
        Gemm("o", m, h, q / tp, layers),
        *mlp,
        Gemm("lm_head", m, model.vocab_size / (tp if vocab_parallel else 1), h, 1),
    ]


def moe_gemms(model: ModelSpec, tokens: float, tp: int = 1, ep: int = 1) -> list[Gemm]:
    """The MoE block's forward GEMMs of ``tokens`` tokens on one device, all layers: the router
    (tokens x E x h, replicated), and each of the device's E / ep local experts (megatron-core's
    ``SequentialMLP``: one GEMM pair per expert, no grouped GEMM) on the rows routed to it. Routing
    assumed balanced (docs/moe.md#planner): the k x tokens rows of each of the ep ranks spread evenly
    over the E experts, so a local expert runs k x tokens x ep / E rows (the all-to-all brings it
    those of every ep rank). Without expert parallelism (ep 1: ddp, fsdp) every expert runs on the
    device, on k x tokens / E rows each. The shared expert (and its gate) runs every token."""
    h, i, e, k = model.hidden_size, model.expert_intermediate_size, model.num_local_experts, model.num_experts_per_tok
    layers, rows = model.num_hidden_layers, tokens * k * ep / e
    out = [
        Gemm("router", tokens, e, h, layers),
        Gemm("experts gate+up", rows, 2 * i / tp, h, layers * e / ep),
        Gemm("experts down", rows, h, i / tp, layers * e / ep),
    ]
    shared = model.shared_expert_intermediate_size
    if shared:
        out += [
            Gemm("shared expert gate+up", tokens, 2 * shared / tp, h, layers),
            Gemm("shared expert down", tokens, h, shared / tp, layers),
            Gemm("shared expert gate", tokens, 1, h, layers),
        ]
    return out


# torchtitan's "op" selective activation checkpointing saves the output of every other mm of a
# block (parallelize_llama.py: ``func == aten.mm and mm_count % 2 == 0`` is recomputed): of the
# seven mms of a Llama block (q, k, v, o, w1, w3, w2 in call order) the 2nd, 4th and 6th (k, o, w3)


def recompute_share(model: ModelSpec, recompute: str) -> float:
    """Forward FLOPs recomputed in the backward, as a share of one forward pass."""
    if recompute == "full":
        return 1.0
    if recompute != "selective_op":
        return 0.0
    h, i, layers = model.hidden_size, model.intermediate_size, model.num_hidden_layers
    kv = model.num_key_value_heads * model.head_dim
    q = model.num_attention_heads * model.head_dim
    per_layer = h * (q + 2 * kv) + h * q + 3 * h * i
    recomputed = h * kv + h * q + h * i  # k, o, w3 (up)
    total = layers * per_layer + model.vocab_size * h
    return layers * recomputed / total


# FlashAttention's backward: 5 GEMMs (the scores recomputed) against the forward's 2 (Dao 2023, sec. 4.1)
FLASH_BACKWARD = 2.5


def _eff(g: Gemm, curve: Curve) -> float:
    """Every GEMM at its shape's intensity but the attention's. On a GPU the attention runs as one
    fused kernel (FlashAttention, Dao 2023) whose tiles stay in on-chip memory: compute-bound whatever
    the sequence, at the curve's ceiling e_max. Where the curve says ``attention_at_shape`` (the
    Ascend 910B: its cube and vector cores exchange the score tiles through global memory,
    docs/sources.md#plan-attention-npu) its two GEMMs run at their per-head shape's intensity: the
    scores (s / cp) x s x d, their product with V (s / cp) x d x s, about d FLOPs per byte."""
    if not g.what.startswith("attention"):
        return curve.eff(g.m, g.n, g.k)
    if not curve.attention_at_shape:
        return curve.e_max
    d = g.head_dim
    return curve.eff(g.m, g.n, d) if g.what == "attention scores" else curve.eff(g.m, d, g.k)


# Bytes of memory-bound traffic per token and layer for each element of a width (h, q = heads x
# head_dim, kv = KV heads x head_dim, i = the MLP width), forward + backward, read + written, 2-byte
# activations (docs/plan.md#memory-bound-work). "fused": the kernels Megatron-core with Transformer
# Engine and MindSpeed's --use-fused-rmsnorm / --use-fused-swiglu / --use-fused-rotary-pos-emb run,
# each one pass over its input and output: two RMSNorms (x -> y forward, x, dy -> dx backward: 5 h
# elements each), two residual adds (3 h forward, 3 h adding the branch gradients), RoPE on q and k
# (2 (q + kv) each way), SwiGLU (2 i -> i forward; 2 i and di -> 2 i backward). "eager": torchtitan's
# Llama without torch.compile (pytorch/torchtitan 9dec370, torchtitan/models/norms.py ``RMSNorm``,
# torchtitan/models/llama/model.py ``apply_rotary_emb``, ``repeat_kv``, ``Attention``,
# ``FeedForward``, ``TransformerBlock``), one kernel per op, and under op-level selective
# checkpointing (``op_sac``) every non-matmul op's forward once more in the backward: an RMSNorm in
# fp32 (.float, pow, mean, x rsqrt, type_as, x weight: 36 bytes forward, 60 backward, 36
# recomputed) twice, the residual adds (30 h), RoPE through complex fp32 (.float, complex multiply,
# type_as: 20 bytes each way and recomputed, on q and k), the attention output's transpose copy (12 q),
# repeat_kv's copies of k and v to q heads (4 kv + 4 q bytes forward, backward, recomputed), SwiGLU's
# silu and multiply (10 bytes forward, 18 backward, 10 recomputed)
LAYER_BYTES = {
    "fused": {"h": 44.0, "q": 8.0, "kv": 8.0, "i": 16.0},
    "eager": {"h": 2 * 132.0 + 30.0, "q": 60.0 + 12.0 + 12.0, "kv": 60.0 + 12.0, "i": 38.0},
}
# per logit: megatron-core 0.16 tensor_parallel/cross_entropy.py ``VocabParallelCrossEntropy`` in
# fp32: forward .float() (2 read + 4 written), max (4), in-place subtract (8), exp (8), sum (4), the
# softmax's in-place divide (8); backward the in-place multiply (8) and the cast back to bf16 for
# the lm_head's backward (6): 52 bytes (torch's eager cross_entropy on .float() logits, torchtitan's
# loss, moves about as much: log_softmax and nll_loss forward and backward)
LOGIT_BYTES = 52.0


def layer_bytes(model: ModelSpec, ops: str = "fused") -> float:
    """Memory-bound bytes of one token through one decoder layer, forward + backward (``LAYER_BYTES``
    of the stack's ``ops``); a MoE layer's SwiGLU runs k routed rows (and the shared expert's)."""
    q = model.num_attention_heads * model.head_dim
    kv = model.num_key_value_heads * model.head_dim
    i = model.intermediate_size
    if model.is_moe:
        i = model.num_experts_per_tok * model.expert_intermediate_size + (model.shared_expert_intermediate_size or 0)
    b = LAYER_BYTES[ops]
    return b["h"] * model.hidden_size + b["q"] * q + b["kv"] * kv + b["i"] * i


def elementwise_bytes(
    model: ModelSpec, seq_len: int, micro_batch: int, tp: int = 1, cp: int = 1, vocab_parallel: bool = True,
    ops: str = "fused",
) -> float:  # fmt: skip
    """Bytes of the memory-bound work of one micro-batch on one device (all layers and the logits):
    tokens x (L x ``layer_bytes`` + ``LOGIT_BYTES`` x V) / tp (V whole without ``vocab_parallel``)."""
    tokens = micro_batch * seq_len / cp
    layers = model.num_hidden_layers * layer_bytes(model, ops) / tp
    return tokens * layers + logit_bytes(model, seq_len, micro_batch, tp, cp, vocab_parallel)


def logit_bytes(
    model: ModelSpec, seq_len: int, micro_batch: int, tp: int = 1, cp: int = 1, vocab_parallel: bool = True
) -> float:
    """Of ``elementwise_bytes``: the output layer's (the logits' cross-entropy, ``LOGIT_BYTES`` per
    logit), tokens x V / tp (V whole without ``vocab_parallel``)."""
    return LOGIT_BYTES * micro_batch * seq_len / cp * model.vocab_size / (tp if vocab_parallel else 1)


def _work(gemms: list[Gemm], peak_flops: float, curve: Curve, recompute: float, attention_recompute: float) -> float:
    """Seconds of forward + backward of one micro-batch through ``gemms`` (see ``step_compute_s``)."""
    forward = sum(g.flops / (peak_flops * _eff(g, curve)) for g in gemms)
    attention = sum(g.flops / (peak_flops * _eff(g, curve)) for g in gemms if g.what.startswith("attention"))
    softmax = sum(g.scores for g in gemms) * curve.sfu_ratio / peak_flops
    work = forward * (3.0 + recompute) + attention * (FLASH_BACKWARD - 2.0 + attention_recompute)
    return work + softmax * (2.0 + recompute + attention_recompute)


def stage_compute_s(
    gemms: list[Gemm], micro_batches: float, pp: int, peak_flops: float, curve: Curve, recompute: float,
    memory_bytes: float = 0.0, attention_recompute: float = 0.0, output_bytes: float = 0.0,
) -> tuple[float, float]:  # fmt: skip
    """(seconds of work of the last pipeline stage per step, of any other stage's): forward + backward
    (3 x the forward GEMMs; the fused attention's backward 2.5 x its forward, FlashAttention-2 sec.
    4.1) + the recomputed share of the forward (and ``attention_recompute`` x the attention core's:
    Megatron's selective recompute), the softmax's exponentials (one per score in the forward, one in
    the backward's recomputation) at the special-function rate peak / ``sfu_ratio``, plus beta x the
    memory-bound ``memory_bytes``, for every micro-batch. A stage runs 1 / pp of the decoder layers; the
    output layer (the ``lm_head`` GEMM and the logits' ``output_bytes``) runs whole on the last
    stage, beside its layers: megatron-core builds it only where ``post_process`` (the last stage,
    ``GPTModel.__init__``) and by default does not count it in the layer split
    (``account_for_loss_in_pipeline_split`` off; docs/sources.md#plan-output-layer)."""
    head = [g for g in gemms if g.what == "lm_head"]
    body = [g for g in gemms if g.what != "lm_head"]
    layers = (_work(body, peak_flops, curve, recompute, attention_recompute) + curve.beta * memory_bytes) / pp
    output = _work(head, peak_flops, curve, recompute, attention_recompute) + curve.beta * output_bytes
    return (layers + output) * micro_batches, layers * micro_batches


def step_compute_s(
    gemms: list[Gemm], micro_batches: float, pp: int, peak_flops: float, curve: Curve, recompute: float,
    memory_bytes: float = 0.0, attention_recompute: float = 0.0, output_bytes: float = 0.0,
) -> float:  # fmt: skip
    """Seconds of work of the busiest (last) pipeline stage per step (``stage_compute_s``)."""
    args = (memory_bytes, attention_recompute, output_bytes)
    return stage_compute_s(gemms, micro_batches, pp, peak_flops, curve, recompute, *args)[0]
