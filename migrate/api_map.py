"""CUDA -> Ascend mapping data used by the migration rules.

Everything the rules need to know about *which* API maps to *what* lives here as plain data, so a
mapping can be checked, cited and updated without touching rule logic.

Sources: docs/sources.md#transfer-to-npu (transfer_to_npu), docs/sources.md#ascend-migration-tool
(Ascend's static tool), docs/sources.md#mindspeed-flags (MindSpeed), docs/sources.md#cuda-constructs-survey
(A/S/M/N classification of constructs found in real training code). The torch.npu member list
(docs/sources.md#npu-api-twins) was checked against ``torch_npu/npu/__init__.py::__all__`` of
Ascend/pytorch (commit 0037c399, repository version.txt 2.10.0.post7).
"""

from __future__ import annotations

TORCH_NPU_VERSION = "2.10.0.post7"
TORCH_NPU_SOURCE = "Ascend/pytorch torch_npu/npu/__init__.py __all__ (commit 0037c399)"

# --- torch.cuda members ----------------------------------------------------------------------
# torch.cuda.<name> that torch.npu provides with the same meaning (docs/sources.md#npu-api-twins, docs/sources.md#class-a-safe).
SUPPORTED: frozenset[str] = frozenset(
    """
    is_available device_count current_device set_device synchronize device device_of StreamContext
    stream set_stream current_stream default_stream Stream Event ExternalEvent
    manual_seed manual_seed_all seed seed_all initial_seed get_rng_state set_rng_state
    get_rng_state_all set_rng_state_all empty_cache memory_stats memory_stats_as_nested_dict
    reset_accumulated_memory_stats reset_peak_memory_stats reset_max_memory_allocated
    reset_max_memory_cached memory_allocated max_memory_allocated memory_reserved max_memory_reserved
    memory_cached max_memory_cached memory_snapshot memory_summary mem_get_info get_device_name
    get_device_properties can_device_access_peer is_bf16_supported is_initialized init
    set_per_process_memory_fraction get_per_process_memory_fraction caching_allocator_alloc
    caching_allocator_delete MemPool use_mem_pool get_allocator_backend change_current_allocator
    set_sync_debug_mode get_sync_debug_mode utilization ipc_collect current_blas_handle
    amp random memory streams
    """.split()
)

# Members of torch.cuda.amp that torch_npu.npu.amp provides (checked: torch_npu/npu/amp/).
AMP_SUPPORTED: frozenset[str] = frozenset({"autocast", "GradScaler", "custom_fwd", "custom_bwd"})

# Legacy tensor/storage types: torch.npu has them, but they are deprecated types (docs/sources.md#class-s-review).
LEGACY_TYPES: frozenset[str] = frozenset(
    """
    FloatTensor DoubleTensor HalfTensor BFloat16Tensor LongTensor IntTensor ShortTensor CharTensor
    ByteTensor BoolTensor FloatStorage DoubleStorage HalfStorage BFloat16Storage LongStorage
    IntStorage ShortStorage CharStorage ByteStorage BoolStorage
    """.split()
)

# torch.cuda.X -> a whole replacement expression (same object in torch itself).
REPLACE: dict[str, str] = {
    "OutOfMemoryError": "torch.OutOfMemoryError",  # torch.cuda.OutOfMemoryError is an alias since torch 2.5
}

# NVTX -> mstx (docs/sources.md#mstx-markers): torch.npu.mstx has mark / range_start / range_end.
NVTX_MAP: dict[str, str] = {"mark": "mark", "range_start": "range_start", "range_end": "range_end"}
# NVTX's stack API -> helpers PY113 adds to the file (a push/pop stack of mstx range ids).
NVTX_STACK: dict[str, str] = {"range_push": "_mstx_range_push", "range_pop": "_mstx_range_pop", "range": "_mstx_range"}

# torch.cuda members torch.npu lacks or that behave differently: reported, never rewritten.
# (docs/sources.md#transfer-to-npu-limits, docs/sources.md#class-m-manual, docs/sources.md#pattern-5.)
UNSUPPORTED: dict[str, str] = {
    "get_device_capability": "returns None on NPU unless TORCH_NPU_DEVICE_CAPABILITY is set: capability gates "
    "(>= (8, 0), .major) crash or mislead; decide by feature (torch.npu.is_bf16_supported()) instead",
    "default_generators": "empty tuple on NPU: use torch.npu.manual_seed / get_rng_state",
    "nccl": "torch.cuda.nccl does not exist on NPU; HCCL is used through torch.distributed",
    "graph": "CUDA graphs: torch.npu.graph/NPUGraph exist with different capture rules; port by hand",
    "CUDAGraph": "CUDA graphs: use torch.npu.NPUGraph (different capture rules); port by hand",
    "make_graphed_callables": "CUDA graphs: torch.npu.make_graphed_callables has different limits; port by hand",
    "graph_pool_handle": "CUDA graphs: use torch.npu.graph_pool_handle; port the capture code by hand",
    "is_current_stream_capturing": "CUDA graphs: use torch.npu.is_current_stream_capturing after porting the capture",
    "jiterator": "no NVRTC jiterator on NPU: write the op with torch ops",
    "comm": "torch.cuda.comm (broadcast/scatter/gather between GPUs) has no NPU twin: use torch.distributed",
    "nvtx": "NVTX: torch.npu.mstx has mark/range_start/range_end (migrated, push/pop/range through a stack helper); "
    "this member has no mstx twin",
    "CUDAPluggableAllocator": "use torch.npu.NPUPluggableAllocator with an NPU allocator library",
    "list_gpu_processes": "no NPU twin: use `npu-smi info`",
    "temperature": "no NPU twin: use `npu-smi info`",
    "power_draw": "no NPU twin: use `npu-smi info`",
    "clock_rate": "no NPU twin: use `npu-smi info`",
    "get_arch_list": "CUDA architectures do not exist on NPU",
    "get_gencode_flags": "CUDA architectures do not exist on NPU",
    "_sleep": "no NPU twin",
    "tunable": "TunableOp is CUDA/ROCm only",
    "cudart": "CUDA runtime bindings do not exist on NPU",
    "is_tf32_supported": "TF32 does not exist on NPU (HF32 is the closest: torch.npu.matmul.allow_hf32)",
}

UNKNOWN_TIP = f"not in the API map checked against torch_npu {TORCH_NPU_VERSION}: verify torch.npu has it"


def classify_cuda_member(path: str) -> tuple[str, str]:
    """Classify the dotted path after ``torch.cuda.`` -> (category, data).

    Categories: supported (data: new dotted path under torch.npu), legacy, replace (data: expression),
    nvtx (data: mstx member), unsupported (data: tip), unknown (data: tip), module (path empty).
    """
    if not path:
        return "module", ""
    head, _, rest = path.partition(".")
    if head == "amp" and rest:
        sub = rest.split(".")[0]
        return ("supported", path) if sub in AMP_SUPPORTED else ("unknown", UNKNOWN_TIP)
    if head == "nvtx":
        sub = rest.split(".")[0]
        if not rest:
            return "unsupported", UNSUPPORTED["nvtx"]
        if sub in NVTX_MAP or sub in NVTX_STACK:
            return "nvtx", NVTX_MAP.get(sub) or NVTX_STACK[sub]
        return "unsupported", UNSUPPORTED["nvtx"]
    if head in SUPPORTED:
        return "supported", path
    if head in LEGACY_TYPES:
        return "legacy", path
    if head in REPLACE and not rest:
        return "replace", REPLACE[head]
    if head in UNSUPPORTED:
        return "unsupported", UNSUPPORTED[head]
    return "unknown", UNKNOWN_TIP


# --- environment variables --------------------------------------------------------------------
# name -> (new name or None to drop, safety, note). docs/sources.md#ascend-env-vars: A (safe), S (review), M (drop + warn).
ENV_MAP: dict[str, tuple[str | None, str, str]] = {
    "CUDA_VISIBLE_DEVICES": ("ASCEND_RT_VISIBLE_DEVICES", "safe", ""),
    "PYTORCH_CUDA_ALLOC_CONF": ("PYTORCH_NPU_ALLOC_CONF", "safe", ""),
    "NCCL_SOCKET_IFNAME": (
        "HCCL_SOCKET_IFNAME",
        "review",
        "HCCL_SOCKET_IFNAME accepts interface names/prefixes like NCCL's",
    ),
    "NCCL_BUFFSIZE": ("HCCL_BUFFSIZE", "review", "NCCL_BUFFSIZE is in bytes, HCCL_BUFFSIZE in MB"),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("HCCL_ASYNC_ERROR_HANDLING", "review", ""),
    "NCCL_ASYNC_ERROR_HANDLING": ("HCCL_ASYNC_ERROR_HANDLING", "review", ""),
    "CUDA_LAUNCH_BLOCKING": (
        "ASCEND_LAUNCH_BLOCKING",
        "review",
        "ASCEND_LAUNCH_BLOCKING=1 also disables the task queue",
    ),
}
# NCCL tuning variables with no HCCL equivalent (docs/sources.md#ascend-env-vars): shell assignments are
# commented out (SH003), Python uses are reported and left in place (PY911); the tips say neither.
ENV_DROP_PREFIXES: tuple[str, ...] = ("NCCL_", "TORCH_NCCL_")
ENV_DROP_TIPS: dict[str, str] = {
    "NCCL_IB_": "InfiniBand tuning has no HCCL equivalent (HCCL uses RoCE; see HCCL_* docs)",
    "NCCL_ALGO": "HCCL chooses algorithms itself (HCCL_ALGO exists with different values: check CANN docs)",
    "NCCL_PROTO": "no HCCL equivalent",
    "NCCL_DEBUG": "use ASCEND_GLOBAL_LOG_LEVEL / ASCEND_SLOG_PRINT_TO_STDOUT for HCCL logs",
    "NCCL_P2P_": "no HCCL equivalent",
    "NCCL_NET_": "no HCCL equivalent",
}
# Left alone on purpose (docs/sources.md#megatron-max-connections): Megatron asserts on it.
ENV_KEEP: frozenset[str] = frozenset({"CUDA_DEVICE_MAX_CONNECTIONS"})


def env_drop_tip(name: str) -> str:
    for prefix, tip in ENV_DROP_TIPS.items():
        if name.startswith(prefix):
            return tip
    return "no HCCL equivalent known"


def is_droppable_env(name: str) -> bool:
    return name not in ENV_MAP and name not in ENV_KEEP and name.startswith(ENV_DROP_PREFIXES)


# --- Python modules that only exist for CUDA (docs/sources.md#cuda-only-packages) ------------------
CUDA_ONLY_MODULES: dict[str, str] = {
    "transformer_engine": "Transformer Engine is CUDA-only: use MindSpeed (--transformer-impl local) or torch modules",
    "triton": "Triton kernels do not run on NPU (triton-ascend is a separate project): port to torch ops or AscendC",
    "flash_attn": "use torch_npu.npu_fusion_attention (different layout [B,S,N,D]/'BSND' and mask semantics) "
    "or F.scaled_dot_product_attention",
    "xformers": "xformers is CUDA-only: use F.scaled_dot_product_attention or torch_npu.npu_fusion_attention",
    "bitsandbytes": "bitsandbytes is CUDA-only: drop 8-bit optimizers/quantization or use an NPU alternative",
    "amp_C": "apex amp_C fused kernels are CUDA-only: use torch._foreach_* ops or torch_npu fused optimizers",
    "apex": "apex is CUDA-only: use torch.autocast / torch.optim / torch_npu.optim equivalents",
    "pynvml": "NVML does not exist on NPU: use `npu-smi info` or torch.npu.memory_* / utilization()",
    "nvidia": "NVIDIA-only package",
    "cupy": "CuPy is CUDA-only",
    "pycuda": "PyCUDA is CUDA-only",
    "numba.cuda": "numba.cuda kernels do not run on NPU",
    "torchao.float8": "FP8 training is not available on this NPU generation: keep bf16",
    "mamba_ssm": "mamba_ssm CUDA kernels: port the selective scan to torch ops",
    "causal_conv1d": "causal_conv1d CUDA kernels: use a torch conv1d fallback",
    "deep_gemm": "DeepGEMM is CUDA-only",
    "torch.distributed._symmetric_memory": "symmetric memory / NVSHMEM is CUDA-only: use torch.distributed collectives",
    "nvshmem": "NVSHMEM is CUDA-only",
    # issue #29: each named CUDA-only by its own documentation (docs/sources.md#cuda-only-packages)
    "helion": "Helion kernels compile to Triton/CuTe/TileIR/Pallas, none for NPU: keep the torch fallback",
    "deep_ep": "DeepEP all-to-all kernels need NVIDIA GPUs and NVSHMEM: use MindSpeed's MoE token dispatcher",
    "megablocks": "MegaBlocks' dropless-MoE kernels are CUDA (stk, grouped_gemm, Triton): use MindSpeed MoE",
    "grouped_gemm": "grouped_gemm is a CUDA (CUTLASS) kernel: use torch_npu.npu_grouped_matmul",
    "torchao.prototype.mx_formats": "torchao MX/NVFP4 kernels need NVIDIA Blackwell (CUDA): keep bf16",
    "torchao.prototype.float8nocompile": "torchao float8 prototype kernels are Triton/CUDA: keep bf16",
    "deepspeed.ops.sparse_attention": "DeepSpeed sparse attention is written in Triton: use dense attention "
    "or torch_npu.npu_fusion_attention with a sparse mask",
}


def cuda_only_module_tip(module: str, local: frozenset[str] = frozenset()) -> str | None:
    """Tip for a dotted module name (longest matching prefix), or names ending in ``_cuda``;
    None for a module of the project itself (``local``: its top-level package and module names,
    so a project's own ``nvidia/`` folder is not NVIDIA's package)."""
    parts = module.split(".")
    if parts[0] in local:
        return None
    for i in range(len(parts), 0, -1):
        tip = CUDA_ONLY_MODULES.get(".".join(parts[:i]))
        if tip:
            return tip
    if parts[0].endswith("_cuda") or parts[0].endswith("_cuda_ext"):
        return "compiled CUDA extension module: port the kernel (AscendC) or use a torch/torch_npu op"
    return None


# apex replacements (docs/sources.md#class-s-review): name in apex module -> replacement in torch.
APEX_NORM: dict[str, str] = {
    "FusedLayerNorm": "torch.nn.LayerNorm",
    "MixedFusedLayerNorm": "torch.nn.LayerNorm",
    "FusedRMSNorm": "torch.nn.RMSNorm",
    "MixedFusedRMSNorm": "torch.nn.RMSNorm",
}
APEX_NORM_MODULES = ("apex.normalization", "apex.normalization.fused_layer_norm")
# apex FusedAdam defaults to adam_w_mode=True, i.e. decoupled weight decay = AdamW.
APEX_OPTIM: dict[str, str] = {"FusedAdam": "torch.optim.AdamW", "FusedSGD": "torch.optim.SGD"}
# what each replacement accepts (PyTorch's signatures, docs/sources.md#class-s-review): at most this
# many positional arguments in apex's order, and these keywords. A call passing anything else
# (apex's `bias_correction`, `adam_w_mode`, `set_grad_none`, a third positional argument of
# FusedAdam, which is bias_correction) would raise TypeError or mean something else: left, reported.
APEX_ACCEPTS: dict[str, tuple[int, frozenset[str]]] = {
    "torch.optim.AdamW": (
        2,
        frozenset({"params", "lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable"}),
    ),
    "torch.optim.SGD": (
        6,
        frozenset({"params", "lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach"}),
    ),
    "torch.nn.LayerNorm": (3, frozenset({"normalized_shape", "eps", "elementwise_affine"})),
    "torch.nn.RMSNorm": (3, frozenset({"normalized_shape", "eps", "elementwise_affine"})),
}
APEX_OPTIM_MODULES = ("apex.optimizers", "apex.optimizers.fused_adam", "apex.optimizers.fused_sgd")

# pip packages that only exist for CUDA (requirements*.txt).
CUDA_ONLY_PACKAGES: dict[str, str] = {
    "flash-attn": "use torch_npu.npu_fusion_attention",
    "flash-attn-3": "use torch_npu.npu_fusion_attention",
    "transformer-engine": "use MindSpeed",
    "transformer-engine-torch": "use MindSpeed",
    "apex": "use torch / torch_npu equivalents",
    "xformers": "use F.scaled_dot_product_attention",
    "bitsandbytes": "CUDA-only",
    "triton": "triton-ascend is a separate project",
    "pynvml": "use npu-smi",
    "nvidia-ml-py": "use npu-smi",
    "nvidia-ml-py3": "use npu-smi",
    "pycuda": "CUDA-only",
    "mamba-ssm": "CUDA kernels",
    "causal-conv1d": "CUDA kernels",
    "deepspeed-kernels": "CUDA kernels",
    "torchao": "FP8/quantization kernels are CUDA-first",
}
CUDA_ONLY_PACKAGE_PREFIXES: tuple[str, ...] = ("nvidia-", "cupy-cuda", "cuda-python")

# Megatron / MindSpeed flags (docs/sources.md#mindspeed-flags).
TE_FLAG_MAP: dict[str, str] = {"--apply-rope-fusion": "--use-fused-rotary-pos-emb"}
TE_ONLY_FLAGS: dict[str, str] = {
    "--fp8-format": "FP8 is unavailable: remove and train in bf16",
    "--fp8": "FP8 is unavailable: remove and train in bf16",
    "--fp8-margin": "FP8 is unavailable",
    "--fp8-interval": "FP8 is unavailable",
    "--fp8-amax-history-len": "FP8 is unavailable",
    "--fp8-amax-compute-algo": "FP8 is unavailable",
    "--fp8-recipe": "FP8 is unavailable",
    "--fp8-param-gather": "FP8 is unavailable",
    "--tp-comm-overlap": "TE userbuffers: MindSpeed offers --use-ascend-mc2 / --use-ascend-coc instead",
    "--te-rng-tracker": "TE RNG tracker: remove (MindSpeed uses the local tracker)",
    "--use-te-rng-tracker": "TE RNG tracker: remove (MindSpeed uses the local tracker)",
}
# fused-kernel flags MindSpeed adds next to a model flag: (flag, value or None) -> fused flag
MINDSPEED_FUSED: tuple[tuple[str, str | None, str], ...] = (
    ("--normalization", "RMSNorm", "--use-fused-rmsnorm"),
    ("--swiglu", None, "--use-fused-swiglu"),
    ("--position-embedding-type", "rope", "--use-fused-rotary-pos-emb"),
)

# Command-line flags that choose the distributed backend in launch scripts.
BACKEND_FLAGS: tuple[str, ...] = (
    "--distributed-backend",
    "--distributed_backend",
    "--dist-backend",
    "--dist_backend",
    "--backend",
    "--ddp-backend",
    "--ddp_backend",
)
DEVICE_FLAGS: tuple[str, ...] = ("--device", "--device_type", "--device-type")
