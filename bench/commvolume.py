"""Theoretical communication per training step, per rank, by collective kind and group.

What one rank of a layout must send per optimizer step, from the papers and framework docs of each
parallelism (docs/sources.md#communication-volume, #comm-volume-sharded, #comm-volume-tensor-parallel,
#comm-volume-pipeline, #comm-volume-padding):

* data parallel (DDP, Megatron DDP): one all-reduce of the gradients per step (gradient
  accumulation skips the sync on all micro-batches but the last); ZeRO paper sec. 7: 2 Psi;
* ZeRO-1 / Megatron distributed optimizer: reduce-scatter of the gradients at the step boundary,
  all-gather of the updated parameters after the step: 2 Psi; ZeRO-2 reduce-scatters the gradients
  of every micro-batch (its gradients are partitioned, so nothing accumulates unreduced);
* ZeRO-3 / FSDP full sharding: all-gather of the parameters before each forward and again before
  each backward, reduce-scatter of the gradients: 3 Psi (Rajbhandari et al. 2020 sec. 7; Zhao et
  al. 2023, FSDP, sec. 3); FSDP2 skips the reduce-scatter on micro-batches without gradient sync
  and keeps the root module (embedding, final norm, lm_head) unsharded between forward and
  backward; ``reshard_after_forward=false`` gathers once per micro-batch (2 Psi);
* tensor parallel (Shoeybi et al. 2019 sec. 3): per layer and micro-batch 2 all-reduces of
  b x s x h activations in the forward pass and 2 in the backward; with sequence parallelism
  (Korthikanti et al. 2022 sec. 4.2.2) each all-reduce becomes an all-gather plus a reduce-scatter
  of the same tensor, and the backward gathers each column-parallel input once more for the weight
  gradient (megatron-core ``tensor_parallel/layers.py``); full recomputation repeats the forward's
  collectives in the backward. The vocab-parallel embedding and lm_head add one activation
  collective each and the vocab-parallel cross entropy three all-reduces of b x s fp32;
* pipeline parallel (Narayanan et al. 2021 sec. 2.2): per micro-batch and stage boundary one
  activation (b x s x h, divided by t under sequence parallelism) forward and its gradient back;
  the interleaved schedule has v chunks per rank, so v times the boundaries;
* context parallel (megatron-core context parallelism, ring attention): per layer and micro-batch,
  cp - 1 ring steps passing a K and V chunk forward, and K, V plus their gradients backward;
* expert parallel (GShard, Lepikhin et al. 2020 sec. 2.2; megatron-core's ``MoEAlltoAllTokenDispatcher``):
  per MoE layer and micro-batch, the dispatch all-to-all of the T x k routed token rows and their
  routing probabilities, the combine all-to-all back, and both again in the backward
  (:func:`moe_all_to_all`).

Units: ``size_bytes`` is one call's full tensor (nccl-tests' "size": the reduced buffer, the
gathered output, the scattered input, the message); ``bus_bytes`` = size x the bus factor
(all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, send/recv 1), the bytes each rank
moves over its links, which is what the ZeRO paper counts ("2 Psi" for an all-reduce of Psi).
Pure Python: the planner (``bench plan``) and ``bench comm`` share it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from parabench.spec import ModelSpec

Kind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv"]
Group = Literal["dp", "tp", "pp", "cp", "ep", "edp"]  # edp: expert data parallel (the experts' dp group)
Sharding = Literal[
    "none",
    "zero1",
    "zero2",
    "zero3",
    "fsdp",
    "fsdp_no_reshard",
    "distributed_optimizer",
    "deepspeed_zero1",
    "deepspeed_zero2",
    "deepspeed_zero3_live",
]
KINDS: tuple[Kind, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv")

SRC_VOLUME = "docs/sources.md#communication-volume"
SRC_SHARDED = "docs/sources.md#comm-volume-sharded"
SRC_TP = "docs/sources.md#comm-volume-tensor-parallel"
SRC_PP = "docs/sources.md#comm-volume-pipeline"
SRC_CP = "docs/sources.md#comm-volume-context-parallel"
SRC_PAD = "docs/sources.md#comm-volume-padding"
SRC_EP = "docs/sources.md#comm-volume-expert-parallel"


def bus_factor(kind: Kind, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: bytes each rank moves per byte of the collective's size."""
    if kind in ("send", "recv"):
        return 1.0
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def ring_steps(kind: Kind, n: int) -> int:
    """Latency terms of a ring algorithm: all-reduce 2(n-1), all-gather/reduce-scatter n-1, p2p 1."""
    if kind in ("send", "recv"):
        return 1
    return 2 * (n - 1) if kind == "all_reduce" else max(n - 1, 0)


@dataclass(frozen=True)
class Layout:
    """How one replica is split and how its model states are sharded over data parallelism."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # model chunks per pipeline rank (interleaved schedule when > 1)
    cp: int = 1
    sequence_parallel: bool = False
    sharding: Sharding = "none"
    recompute: Literal["none", "selective", "full"] = "none"
    # embedding, lm_head and cross entropy split over tp too (Megatron); False: only the decoder
    # layers' attention and MLP (FSDP2 + TP, adapters/fsdp.py)
    vocab_parallel: bool = True
    # full recomputation through torch.utils.checkpoint (non-reentrant): it stops once the tensors the
    # backward saved are back (set_checkpoint_early_stop, on by default), before the layer's last
    # row-parallel all-reduce, whose output no backward saves: 1 recomputed all-reduce per layer, not 2
    recompute_stops_early: bool = False
    ep: int = 1  # expert-parallel ranks (MoE): carved out of the data-parallel ranks


@dataclass(frozen=True)
class Widths:
    """Bytes per element on the wire: parameters gathered, gradients reduced, activations sent."""

    param: int
    grad: int
    activation: int

    @classmethod
    def for_precision(cls, precision: str, grad_fp32: bool = False) -> Widths:
        """bf16/fp16 moves 2-byte parameters and activations; gradients too unless the backend
        reduces them in fp32 (FSDP2's reduce_dtype, Megatron's grad_reduce_in_fp32, DDP under autocast)."""
        b = 4 if precision == "fp32" else 2
        return cls(param=b, grad=4 if grad_fp32 else b, activation=b)


@dataclass(frozen=True)
class Batch:
    seq_len: int
    micro_batch_size: int
    micro_batches: int  # per step on one data-parallel replica (gradient-accumulation steps)


@dataclass(frozen=True)
class Collective:
    """One kind of call a rank makes every step, ``calls`` times, each of ``size_bytes``."""

    kind: Kind
    group: Group
    group_size: int
    size_bytes: float
    calls: int
    what: str
    source: str

    @property
    def bus_bytes(self) -> float:
        """Bytes this rank moves over its links per step for these calls."""
        return self.size_bytes * self.calls * bus_factor(self.kind, self.group_size)

    def seconds(self, alpha_s: float, bytes_per_s: float) -> float:
        """Alpha-beta (ring) time of these calls: alpha x ring steps + bus bytes / bandwidth."""
        return self.calls * alpha_s * ring_steps(self.kind, self.group_size) + self.bus_bytes / bytes_per_s


@dataclass(frozen=True)
class StepComm:
    """Everything one rank communicates in one optimizer step."""

    collectives: tuple[Collective, ...] = field(default_factory=tuple)

    def bus_bytes(self, group: Group | None = None) -> float:
        return sum(c.bus_bytes for c in self.collectives if group in (None, c.group))

    def by_kind(self) -> dict[str, float]:
        """Bus bytes per rank and step for each collective kind (kinds with none omitted)."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.bus_bytes
        return out

    def as_rows(self) -> list[dict[str, object]]:
        return [
            {
                "kind": c.kind,
                "group": c.group,
                "group_size": c.group_size,
                "size_bytes": c.size_bytes,
                "calls": c.calls,
                "bus_bytes": c.bus_bytes,
                "what": c.what,
                "source": c.source,
            }
            for c in self.collectives
        ]


# --------------------------------------------------------------------------------------------
# Padding: the elements a backend actually communicates for a data-parallel shard.
# --------------------------------------------------------------------------------------------
def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fsdp2_padded_numel(shapes: Iterable[Sequence[int]], world: int) -> int:
    """FSDP2 shards each parameter on dim 0, padding dim 0 to a multiple of the world size."""
    return sum(round_up(s[0], world) * math.prod(s[1:]) for s in shapes)


# Megatron's split of a decoder layer (Shoeybi et al. 2019, sec. 3; docs/sources.md#fsdp2-tensor-parallel):
# column-parallel projections split their output features (weight dim 0, bias), row-parallel ones their
# input features (weight dim 1); everything else (embedding, norms, lm_head) is replicated over tp.
TP_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
TP_ROWWISE = ("o_proj", "down_proj")


def tp_shard_shapes(model: ModelSpec, tp: int) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape on one tensor-parallel rank when only the decoder layers' attention and
    MLP projections are split (FSDP2 + DTensor TP, torchtitan's per-layer plan without the vocab split)."""
    out = {}
    for name, shape in model.parameter_shapes().items():
        module = name.rsplit(".", 2)[-2] if ".layers." in name else ""
        dim = 0 if module in TP_COLWISE else 1 if module in TP_ROWWISE and name.endswith(".weight") else None
        out[name] = tuple(n // tp if d == dim else n for d, n in enumerate(shape))
    return out


def deepspeed_flat_numel(group_numels: Iterable[int], dp: int, element_bytes: int = 2) -> int:
    """DeepSpeed ZeRO-1/2 flattens each parameter group and pads it to a multiple of
    2 x dp elements (``nccl_start_alignment_factor`` x world size, stage_1_and_2.py)."""
    del element_bytes  # the alignment factor is fixed at 2 elements in DeepSpeed 0.16-0.19
    return sum(round_up(n, 2 * dp) for n in group_numels)


def zero3_padded_numel(numels: Iterable[int], dp: int) -> int:
    """DeepSpeed ZeRO-3 partitions each parameter on its own: ceil(numel / dp) elements per rank."""
    return sum(round_up(n, dp) for n in numels)


# --------------------------------------------------------------------------------------------
# The volumes.
# --------------------------------------------------------------------------------------------
def step_comm(
    model: ModelSpec,
    layout: Layout,
    batch: Batch,
    widths: Widths,
    *,
    dp_elements: int | None = None,
    root_elements: int | None = None,
) -> StepComm:
    """Per-rank, per-step collectives of ``layout`` training ``model`` on ``batch``.

    ``dp_elements``: parameters this rank's data-parallel group synchronises (its TP/PP shard,
    padded as the backend pads; see the ``*_numel`` helpers); default: all parameters over tp x pp,
    unpadded. ``root_elements``: for FSDP, parameters of the root module (default: embedding,
    final norm and lm_head of ``model``)."""
    elements = dp_elements if dp_elements is not None else model.num_params() // (layout.tp * layout.pp)
    out = list(_data_parallel(model, layout, batch, widths, elements, root_elements))
    out += _tensor_parallel(model, layout, batch, widths)
    out += _pipeline(model, layout, batch, widths)
    out += _context_parallel(model, layout, batch, widths)
    return StepComm(tuple(c for c in out if c.calls > 0))


def _data_parallel(
    model: ModelSpec, layout: Layout, batch: Batch, widths: Widths, elements: int, root: int | None
) -> list[Collective]:
    n, m, sh = layout.dp * layout.cp, batch.micro_batches, layout.sharding
    if n <= 1:
        return []
    grads, params = elements * widths.grad, elements * widths.param

    def c(kind: Kind, size: float, calls: int, what: str) -> Collective:
        return Collective(kind, "dp", n, size, calls, what, SRC_SHARDED if sh != "none" else SRC_VOLUME)

    if sh == "none":
        return [c("all_reduce", grads, 1, "gradient all-reduce (last micro-batch only)")]
    if sh in ("zero1", "distributed_optimizer"):
        return [
            c("reduce_scatter", grads, 1, "gradient reduce-scatter at the step boundary"),
            c("all_gather", params, 1, "updated-parameter all-gather after the step"),
        ]
    if sh == "zero2":
        return [
            c("reduce_scatter", grads, m, "gradient reduce-scatter every micro-batch"),
            c("all_gather", params, 1, "updated-parameter all-gather after the step"),
        ]
    # DeepSpeed 0.19 as configured by default (measured by bench run's communication log, docs/comm.md):
    # ZeRO-1/2 all-reduce every gradient bucket that spans several ranks' partitions
    # (use_multi_rank_bucket_allreduce: true, stage_1_and_2.py average_tensor) and all-gather the
    # updated parameters; ZeRO-3 keeps gathered parameters live from forward to backward while they fit
    # stage3_max_live_parameters / max_reuse_distance (1e9 each), so it gathers once per micro-batch.
    if sh in ("deepspeed_zero1", "deepspeed_zero2"):
        calls = 1 if sh == "deepspeed_zero1" else m  # stage 2 reduces every micro-batch's gradients
        return [
            c("all_reduce", grads, calls, "gradient bucket all-reduce (multi-rank buckets)"),
            c("all_gather", params, 1, "updated-parameter all-gather after the step"),
        ]
    if sh == "deepspeed_zero3_live":
        return [
            c("all_gather", params, m, "parameter all-gather per micro-batch (kept live for the backward)"),
            c("reduce_scatter", grads, m, "gradient reduce-scatter every micro-batch"),
        ]
    if sh == "zero3":
        return [
            c("all_gather", params, 2 * m, "parameter all-gather before forward and before backward"),
            c("reduce_scatter", grads, m, "gradient reduce-scatter every micro-batch"),
        ]
    root_n = _root_elements(model) if root is None else root
    once = root_n * widths.param
    gathers = [c("all_gather", params - once, 2 * m, "layer parameter all-gather before forward and backward")]
    if sh == "fsdp_no_reshard":
        gathers = [c("all_gather", params - once, m, "layer parameter all-gather per micro-batch")]
    return gathers + [
        c("all_gather", once, m, "root (embedding, norm, lm_head) all-gather per micro-batch"),
        c("reduce_scatter", grads, 1, "gradient reduce-scatter (last micro-batch only)"),
    ]


def repeated_param_gathers(collectives: Iterable[Collective], times: int) -> list[Collective]:
    """``collectives`` with the data-parallel parameter all-gathers (dp and expert dp) made ``times``
    per step: a framework that gathers the distributed optimizer's parameters more than once
    (megatron-core with MoE: one gather per optimizer of its chain, adapters/megatron_profile.py)."""
    return [
        replace(c, calls=c.calls * times) if c.kind == "all_gather" and c.group in ("dp", "edp") else c
        for c in collectives
    ]


def expert_data_parallel(
    model: ModelSpec, layout: Layout, batch: Batch, widths: Widths, elements: int
) -> list[Collective]:
    """The data-parallel collectives of a rank's experts (``elements``: its E / ep experts, padded as
    the backend pads), which megatron-core runs over the expert-data-parallel group, dp x cp / ep ranks
    at expert tp = tp (``parallel_state.initialize_model_parallel``: the expert rank generator's dp;
    the experts' grad buffers are reduced over ``get_expert_data_parallel_group``), not over dp: the
    same formulas as the dense parameters' (:func:`step_comm`) on that group, labelled ``edp``."""
    sub = replace(layout, dp=layout.dp * layout.cp // layout.ep, cp=1)
    return [
        replace(c, group="edp", what="experts: " + c.what)
        for c in _data_parallel(model, sub, batch, widths, elements, 0)
    ]


def _root_elements(model: ModelSpec) -> int:
    return sum(math.prod(s) for name, s in model.parameter_shapes().items() if ".layers." not in name)


def _tensor_parallel(model: ModelSpec, layout: Layout, batch: Batch, widths: Widths) -> list[Collective]:
    t = layout.tp
    if t <= 1:
        return []
    m, layers = batch.micro_batches, model.num_hidden_layers // layout.pp
    act = batch.micro_batch_size * batch.seq_len // layout.cp * model.hidden_size * widths.activation
    redo = 1 if layout.recompute == "full" else 0  # the recomputed forward repeats its collectives

    def c(kind: Kind, calls: int, what: str, size: float = act) -> Collective:
        return Collective(kind, "tp", t, size, calls, what, SRC_TP)

    if layout.sequence_parallel:
        n = _sp_blocks(model)
        out = [
            c("all_gather", m * layers * n * (2 + redo), "SP: layer input all-gathers (fwd, bwd wgrad, recompute)"),
            c("reduce_scatter", m * layers * n * (1 + redo), "SP: layer output reduce-scatters (fwd, recompute)"),
            c("reduce_scatter", m * layers * n, "SP: backward of the input all-gathers"),
            c("all_gather", m * layers * n, "SP: backward of the output reduce-scatters"),
        ]
    else:
        again = (1 if layout.recompute_stops_early else 2) * redo
        out = [c("all_reduce", m * layers * (2 + 2 + again), "TP: 2 fwd + 2 bwd all-reduces per layer")]
    if layout.sequence_parallel:
        out.append(_sp_param_grads(model, layout, widths))
    if not layout.vocab_parallel:  # embedding, lm_head and loss replicated: nothing beyond the layers
        return out
    if layout.pp == 1:  # the busiest rank: with pp > 1 the last stage (lm_head, cross entropy)
        kind: Kind = "reduce_scatter" if layout.sequence_parallel else "all_reduce"
        out.append(c(kind, m, "vocab-parallel embedding output"))
    if layout.pp == 1 and layout.sequence_parallel:  # its backward (mappings.py _ReduceScatterToSequenceParallelRegion)
        out.append(c("all_gather", m, "vocab-parallel embedding output grad (bwd)"))
    if layout.sequence_parallel:  # the column-parallel lm_head re-gathers its input for wgrad (layers.py backward)
        out += [
            c("all_gather", 2 * m, "lm_head input (fwd, bwd wgrad re-gather)"),
            c("reduce_scatter", m, "lm_head input grad (bwd)"),
        ]
    else:
        out.append(c("all_reduce", m, "lm_head input grad (bwd)"))
    ce = batch.micro_batch_size * batch.seq_len // layout.cp * 4
    out.append(c("all_reduce", 3 * m, "vocab-parallel cross entropy (max, target logit, sum exp)", ce))
    return out


_SP_PARAMS = ("norm.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")


def _sp_param_grads(model: ModelSpec, layout: Layout, widths: Widths) -> Collective:
    """The tensor ranks' one coalesced all-reduce of the replicated parameters marked
    ``sequence_parallel`` (megatron-core 0.16 ``distributed/finalize_model_grads.py``
    ``_allreduce_non_tensor_model_parallel_grads``): the layer norms (``extensions/transformer_engine.py``),
    a MoE router's weight (``transformer/moe/router.py``) and a shared expert's gate
    (``transformer/moe/shared_experts.py``); the busiest rank's layers and the final norm."""
    shapes = model.parameter_shapes()
    per_layer = sum(
        math.prod(s) for n, s in shapes.items() if n.startswith("model.layers.0.") and n.endswith(_SP_PARAMS)
    )
    size = (per_layer * (model.num_hidden_layers // layout.pp) + model.hidden_size) * widths.grad
    return Collective("all_reduce", "tp", layout.tp, size, 1, "SP: sequence-parallel params' grads", SRC_TP)


def _sp_blocks(model: ModelSpec) -> int:
    """Blocks of a decoder layer whose input sequence parallelism all-gathers and whose output it
    reduce-scatters: attention and the dense MLP. A MoE layer's routed experts do neither (megatron-core
    0.16 ``tensor_parallel/layers.py``: an expert linear's ``explicit_expert_comm`` turns its sequence
    parallelism off; the token dispatcher gathers their rows instead, :func:`moe_all_to_all`); its
    shared expert is a dense MLP (``SharedExpertMLP``) and does."""
    if not model.is_moe:
        return 2
    return 2 if model.shared_expert_intermediate_size else 1


def tp_backward_async(model: ModelSpec, layout: Layout, batch: Batch, widths: Widths) -> list[Collective]:
    """Of the decoder layers' tensor-parallel collectives (``_tensor_parallel``), the ones megatron-core's
    column-parallel linears (qkv, gate+up: two per layer; a MoE layer's routed experts none) issue
    asynchronously in their backward, without tp_comm_overlap (``LinearWithGradAccumulationAndAsyncCommunication.backward``,
    megatron/core/tensor_parallel/layers.py; docs/sources.md#plan-tp-backward-overlap): with sequence
    parallelism the re-gather of the input for the weight gradient (``async_op=True`` before the
    input-gradient GEMM) and the input gradient's reduce-scatter (before the weight-gradient GEMM);
    without it the input gradient's all-reduce (before the weight-gradient GEMM). A subset of
    ``step_comm``'s: the same calls, listed again so a planner can tell them apart."""
    t = layout.tp
    if t <= 1:
        return []
    calls = batch.micro_batches * (model.num_hidden_layers // layout.pp) * _sp_blocks(model)
    act = batch.micro_batch_size * batch.seq_len // layout.cp * model.hidden_size * widths.activation
    if layout.sequence_parallel:
        return [
            Collective("all_gather", "tp", t, act, calls, "SP: column-parallel input re-gather (bwd, behind dgrad)", SRC_TP),
            Collective("reduce_scatter", "tp", t, act, calls, "SP: column-parallel input-grad reduce-scatter (bwd, behind wgrad)", SRC_TP),
        ]  # fmt: skip
    return [Collective("all_reduce", "tp", t, act, calls, "TP: column-parallel input-grad all-reduce (bwd, behind wgrad)", SRC_TP)]  # fmt: skip


def _pipeline(model: ModelSpec, layout: Layout, batch: Batch, widths: Widths) -> list[Collective]:
    p, v, m = layout.pp, layout.vpp, batch.micro_batches
    if p <= 1:
        return []
    act = batch.micro_batch_size * batch.seq_len // layout.cp * model.hidden_size * widths.activation
    if layout.sequence_parallel:
        act //= layout.tp
    # The busiest rank: each of its v chunks sends its output forward and its input's gradient
    # backward, except the very last chunk (no successor) and the very first (no predecessor);
    # with p >= 3 a middle rank has neither, with p == 2 every rank holds one of them.
    calls = (2 * v - (1 if p == 2 else 0)) * m
    return [
        Collective("send", "pp", p, act, calls, "activation forward + its gradient backward", SRC_PP),
        Collective("recv", "pp", p, act, calls, "the neighbours' activations and gradients", SRC_PP),
    ]


def _context_parallel(model: ModelSpec, layout: Layout, batch: Batch, widths: Widths) -> list[Collective]:
    cp = layout.cp
    if cp <= 1:
        return []
    layers, m = model.num_hidden_layers // layout.pp, batch.micro_batches
    kv_heads = max(model.num_key_value_heads // layout.tp, 1)
    chunk = 2 * batch.micro_batch_size * (batch.seq_len // cp) * kv_heads * model.head_dim * widths.activation
    calls = m * layers * (cp - 1) * (1 + 2)  # forward K,V; backward K,V and dK,dV
    return [
        Collective("send", "cp", cp, chunk, calls, "ring attention K/V (and grads) to the next CP rank", SRC_CP),
        Collective("recv", "cp", cp, chunk, calls, "ring attention K/V (and grads) from the previous CP rank", SRC_CP),
    ]


def moe_all_to_all(
    model: ModelSpec,
    batch: Batch,
    widths: Widths,
    ep: int,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    scalar_elements: int = 0,
) -> list[Collective]:
    """Expert-parallel token dispatch and combine of one rank per step (megatron-core 0.16
    ``token_dispatcher.py``, ``MoEAlltoAllTokenDispatcher``; docs/sources.md#comm-volume-expert-parallel).

    Per MoE layer and micro-batch a rank holds T = b x s / cp tokens and, dropless, sends T x k rows
    of h activations (its ``permutated_local_input_tokens``, also the rows bound for its own experts)
    plus their T x k routing probabilities (activation dtype: the router's input dtype) in the
    dispatch, receives the rows its experts were routed and sends those back in the combine; the
    backward repeats each all-to-all with the splits swapped (probabilities included: they carry the
    router's gradient). The dispatch's and the combine-backward's sizes are T x k rows on every rank;
    the combine's and the dispatch-backward's are the rows the rank's experts received, which depends
    on the routing: T x k on average over the ep ranks (every row sent is received once), so these
    figures are exact for the mean over the ep ranks and a lower bound of the busiest one. Before the
    dispatch the ranks all-gather their tokens per expert (E int64 each) over the tensor x expert
    ranks, a scalar-sized call when tp x ep x E <= ``scalar_elements`` (the communication log keeps
    those apart).

    Expert tensor parallelism (tp > 1, with the sequence parallelism megatron-core's MoE layer demands
    in training): each tensor rank routes its T / tp tokens, so the all-to-alls carry T k / tp rows, and
    the tensor ranks then all-gather the rows their experts received and reduce-scatter the experts'
    output (:func:`_moe_tensor_parallel`)."""
    if ep * tp <= 1 or not model.is_moe:
        return []
    m, layers = batch.micro_batches, model.num_hidden_layers // pp
    rows = batch.micro_batch_size * batch.seq_len // cp // tp * model.num_experts_per_tok
    out = _moe_dispatch(model, widths, ep, rows, m * layers) if ep > 1 else []
    out += _moe_tensor_parallel(model, batch, widths, tp, pp=pp, cp=cp)
    counts = tp * ep * model.num_local_experts
    if counts > scalar_elements:
        out.append(Collective("all_gather", "ep", tp * ep, counts * 8, m * layers, "MoE tokens per expert", SRC_EP))
    return out


def _moe_dispatch(model: ModelSpec, widths: Widths, ep: int, rows: int, passes: int) -> list[Collective]:
    """The expert ranks' all-to-alls of ``rows`` routed rows per MoE layer pass (``passes``: micro-batches
    x local layers): activations in the dispatch and combine, forward and backward, and the routing
    probabilities with the dispatch, forward and backward (see :func:`moe_all_to_all`)."""
    return [
        Collective(
            "all_to_all",
            "ep",
            ep,
            rows * model.hidden_size * widths.activation,
            4 * passes,
            "MoE token dispatch + combine, forward and backward (mean over ep ranks)",
            SRC_EP,
        ),
        Collective(
            "all_to_all",
            "ep",
            ep,
            rows * widths.activation,
            2 * passes,
            "MoE routing probabilities with the dispatch, forward and backward",
            SRC_EP,
        ),
    ]


def _moe_tensor_parallel(
    model: ModelSpec, batch: Batch, widths: Widths, tp: int, *, pp: int, cp: int
) -> list[Collective]:
    """The alltoall token dispatcher's collectives over the tensor ranks with expert tensor parallelism
    (megatron-core 0.16 ``MoEAlltoAllTokenDispatcher``: ``dispatch_postprocess`` all-gathers the rows
    and their probabilities with ``gather_from_sequence_parallel_region``, ``combine_preprocess``
    reduce-scatters the experts' output with ``reduce_scatter_to_sequence_parallel_region``; each one's
    backward is the other). Per MoE layer and micro-batch the gathered rows are the tensor group's T x
    k (T = b x s / cp): exact at ep = 1, the mean over the expert ranks with ep > 1."""
    if tp <= 1:
        return []
    m, layers = batch.micro_batches, model.num_hidden_layers // pp
    rows = batch.micro_batch_size * batch.seq_len // cp * model.num_experts_per_tok
    tokens, probs = rows * model.hidden_size * widths.activation, rows * widths.activation

    def c(kind: Kind, size: float, calls: int, what: str) -> Collective:
        return Collective(kind, "tp", tp, size, calls * m * layers, what, SRC_EP)

    return [
        c("all_gather", tokens, 2, "MoE dispatcher: routed rows gathered over the tensor ranks (fwd), combine (bwd)"),
        c("reduce_scatter", tokens, 2, "MoE dispatcher: experts' output reduce-scattered (fwd), the gather (bwd)"),
        c("all_gather", probs, 1, "MoE dispatcher: routing probabilities gathered over the tensor ranks (fwd)"),
        c("reduce_scatter", probs, 1, "MoE dispatcher: routing probabilities' gradient (bwd)"),
    ]


__all__ = [
    "KINDS",
    "Batch",
    "Collective",
    "Layout",
    "StepComm",
    "Widths",
    "bus_factor",
    "deepspeed_flat_numel",
    "expert_data_parallel",
    "repeated_param_gathers",
    "fsdp2_padded_numel",
    "moe_all_to_all",
    "ring_steps",
    "tp_shard_shapes",
    "round_up",
    "step_comm",
    "zero3_padded_numel",
]
