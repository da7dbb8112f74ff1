"""MindSpeed: Megatron-Core on Ascend NPUs (torch_npu, HCCL) with MindSpeed's fused kernels.

Written as it runs on an Atlas/Ascend cluster; this CPU machine can only diagnose why it cannot run
(``bench env``) and write the launch bundle (``launcher.dry_run=true``). Nothing here reports an NPU
number from a run that was not on an NPU: a request without an NPU is refused before launch.

The model, the canonical->Megatron weight mapping, the schedules and the metrics are the Megatron
adapter's (this class derives from it). What MindSpeed adds, inside the worker process only:
1. ``import torch_npu`` (the NPU device's setup), HCCL as the process-group backend;
2. MindSpeed's feature switches become the command-line flags MindSpeed's argument parser reads
   (``mindspeed.arguments`` parses ``sys.argv`` when ``mindspeed.megatron_adaptor`` is imported):
   the launcher puts them after the run directory on every worker's command line (``worker_args``);
3. ``import mindspeed.megatron_adaptor`` before megatron-core is imported: it applies
   ``torch_npu.contrib.transfer_to_npu`` (so parabench's own CUDA redirection is not installed on
   top) and patches Megatron symbols with the NPU kernels (docs/sources.md#mindspeed-adaptor).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from dataclasses import dataclass, replace
from typing import Literal

from parabench.adapters.base import Availability, Capabilities, Engine, WorkerContext
from parabench.adapters.megatron import MegatronAdapter, MegatronOptions
from parabench.adapters.megatron_build import moe_config, recompute_settings
from parabench.adapters.megatron_engine import MegatronEngine
from parabench.adapters.megatron_profile import PROFILE as MEGATRON_PROFILE
from parabench.adapters.profile import no_experts
from parabench.devices import AUTOLOAD_TEXT, NPUDevice, cann_library, cann_version, package_version
from parabench.errors import SpecError
from parabench.spec import JobSpec

# Version sets known to work together, with where that is stated. Anything else is refused with
# the set found, since mismatches fail late with undefined symbols (docs/sources.md#mindspeed-versions).
KNOWN_GOOD = [
    {
        "source": "Ascend/MindSpeed-LLM README (2026): MindSpeed 26.0.0_core_r0.12.1 release",
        "torch": "2.7.1",
        "torch-npu": "2.7.1.post4",
        "cann": "9.0.0",
        "mindspeed": "26.0.0",
        "megatron-core": "0.12.1",
    },
]
MINDSPEED_INSTALL = (
    "mindspeed is not installed: install Ascend's MindSpeed matching your torch_npu/CANN "
    "(e.g. pip install -e MindSpeed from its core_r0.12.1 branch) - see docs/ascend.md"
)

# Ascend environment the runner sets for every worker (docs/sources.md#mindspeed-launch-env, MindSpeed-LLM launch
# scripts); logged with the run and written into the launch bundle.
HCCL_ENV = {
    "HCCL_CONNECT_TIMEOUT": "1200",
    "HCCL_EXEC_TIMEOUT": "1200",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "TASK_QUEUE_ENABLE": "2",
    "HCCL_ASYNC_ERROR_HANDLING": "1",
}


@dataclass(frozen=True)
class MindSpeedOptions(MegatronOptions):
    # MindSpeed replaces Megatron's local layers with NPU kernels; mindspeed_argv passes
    # --transformer-impl local (conf/backend/mindspeed.yaml says the same)
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "local"
    use_fused_rmsnorm: bool = True  # --use-fused-rmsnorm: NPU RMSNorm kernel
    use_fused_swiglu: bool = True  # --use-fused-swiglu
    use_fused_rotary_pos_emb: bool = True  # --use-fused-rotary-pos-emb
    use_flash_attn: bool = True  # --use-flash-attn: torch_npu.npu_fusion_attention
    context_parallel_algo: Literal["ulysses_cp_algo", "megatron_cp_algo", "hybrid_cp_algo", "adaptive_cp_algo"] = (
        "megatron_cp_algo"
    )
    reuse_fp32_param: bool = False  # --reuse-fp32-param: bf16 params share the fp32 main copy's memory
    recompute_activation_function: bool = False  # --recompute-activation-function
    swap_attention: bool = False  # --swap-attention
    optimization_level: int = 2  # --optimization-level {0,1,2}
    visible_devices: str = ""  # ASCEND_RT_VISIBLE_DEVICES for the node, e.g. "0,1,2,3,4,5,6,7"; "" = all


def mindspeed_argv(job: JobSpec) -> list[str]:
    """The flags MindSpeed's argument parser reads for this job (Megatron's + MindSpeed's own)."""
    o = job.backend.options
    args = [
        f"--tensor-model-parallel-size={o.tp}",
        f"--pipeline-model-parallel-size={o.pp}",
        f"--context-parallel-size={o.cp}",
        f"--micro-batch-size={job.data.micro_batch_size}",
        f"--global-batch-size={job.data.global_batch_size}",
        f"--seq-length={job.data.seq_len}",
        f"--num-layers={job.model.num_hidden_layers}",
        f"--hidden-size={job.model.hidden_size}",
        f"--ffn-hidden-size={job.model.intermediate_size}",
        f"--num-attention-heads={job.model.num_attention_heads}",
        "--group-query-attention",
        f"--num-query-groups={job.model.num_key_value_heads}",
        "--normalization=RMSNorm",
        "--swiglu",
        "--position-embedding-type=rope",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--transformer-impl=local",
        "--distributed-backend=nccl",
        f"--optimization-level={o.optimization_level}",
    ]
    if o.vpp > 1:
        args.append(f"--num-layers-per-virtual-pipeline-stage={job.model.num_hidden_layers // (o.pp * o.vpp)}")
    if job.run.precision == "bf16":
        args.append("--bf16")
    if o.cp > 1:
        args.append(f"--context-parallel-algo={o.context_parallel_algo}")
    recompute = recompute_settings(o)
    if recompute["recompute_granularity"] is not None:
        args += [f"--{key.replace('_', '-')}={value}" for key, value in recompute.items()]
    args += moe_argv(job)
    for flag, on in (
        ("--sequence-parallel", o.sequence_parallel),
        ("--use-distributed-optimizer", o.distributed_optimizer),
        ("--overlap-grad-reduce", o.overlap_grad_reduce),
        ("--overlap-param-gather", o.overlap_param_gather),
        ("--use-fused-rmsnorm", o.use_fused_rmsnorm),
        ("--use-fused-swiglu", o.use_fused_swiglu),
        ("--use-fused-rotary-pos-emb", o.use_fused_rotary_pos_emb),
        ("--use-flash-attn", o.use_flash_attn),
        ("--reuse-fp32-param", o.reuse_fp32_param),
        ("--recompute-activation-function", o.recompute_activation_function),
        ("--swap-attention", o.swap_attention),
    ):
        if on:
            args.append(flag)
    return args


# Megatron-LM's flag for each TransformerConfig field whose flag is not the field's own name with
# '-' for '_' (megatron/training/arguments.py, core_transformer_config_from_args: num_moe_experts =
# args.num_experts; every other field is read from the argument of its own name).
MOE_FLAG_NAMES = {"num_moe_experts": "num-experts"}


def moe_argv(job: JobSpec) -> list[str]:
    """Megatron-LM's MoE flags for the MoE layer the megatron engine builds (``moe_config``: the same
    TransformerConfig fields, so MindSpeed's parser and the engine agree): a value flag for each set
    field, a store_true flag for each true one; false and None are Megatron-LM's defaults, left out.
    Megatron-LM core_v0.12.1 megatron/training/arguments.py ``_add_moe_args`` defines every one of
    them (MindSpeed 26.0.0_core_r0.12.1 extends that parser: mindspeed/arguments.py)."""
    flags = []
    for field, value in moe_config(job.model, job.backend.options).items():
        flag = "--" + MOE_FLAG_NAMES.get(field, field.replace("_", "-"))
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags.append(f"{flag}={value}")
    return flags


def version_set() -> dict[str, str | None]:
    return {
        "torch": package_version("torch"),
        "torch-npu": package_version("torch-npu"),
        "cann": cann_version(),
        "mindspeed": package_version("mindspeed"),
        "megatron-core": package_version("megatron-core"),
    }


def check_matrix(found: dict[str, str | None]) -> str | None:
    """None when ``found`` matches a known-good set (version prefixes), else why not."""
    for good in KNOWN_GOOD:
        if all((found.get(k) or "").split("+")[0].startswith(v) for k, v in good.items() if k != "source"):
            return None
    have = ", ".join(f"{k} {v or 'missing'}" for k, v in found.items())
    want = "; ".join(
        ", ".join(f"{k} {v}" for k, v in g.items() if k != "source") + f" ({g['source']})" for g in KNOWN_GOOD
    )
    return f"version set not known to work together: {have}. Known good: {want}"


class MindSpeedAdapter(MegatronAdapter):
    name = "mindspeed"
    capabilities = Capabilities(
        devices=frozenset({"npu"}),
        precisions=frozenset({"fp32", "bf16"}),
        shards_model_states=True,
        # docs/moe.md#mindspeed: its MoE flags are written and parsed, the engine path is not checked
        moe_refusal=(
            "the megatron engine's MoE layer, expert parallelism and its mapping are checked with megatron-core "
            "0.16 only, while MindSpeed's known-good set pairs with megatron-core 0.12.1"
        ),
    )
    Options = MindSpeedOptions
    distributions = ("torch", "torch-npu", "megatron-core")
    known_good = tuple(KNOWN_GOOD)
    # megatron's profile without expert parallelism (a MoE model is refused: Capabilities.moe)
    plan_profile = replace(MEGATRON_PROFILE, experts=no_experts)

    @classmethod
    def availability(cls) -> Availability:
        found = version_set()
        versions = {k: v for k, v in found.items() if v}
        if not found["torch-npu"] or importlib.util.find_spec("torch_npu") is None:
            return Availability(
                False, "torch_npu is not installed (pip install torch-npu on a machine with the CANN toolkit)", versions
            )
        if cann_library() is None:
            return Availability(
                False,
                f"torch_npu {found['torch-npu']} is installed but the CANN runtime (libhccl.so) is not found: "
                "install CANN and source set_env.sh (until then `import torch` needs "
                f"{AUTOLOAD_TEXT}, which parabench sets)",
                versions,
            )
        if not found["mindspeed"] or importlib.util.find_spec("mindspeed") is None:
            return Availability(False, MINDSPEED_INSTALL, versions)
        if not found["megatron-core"]:
            return Availability(
                False,
                "megatron-core is not installed (MindSpeed patches it: pip install 'parabench[megatron]')",
                versions,
            )
        presence = NPUDevice.presence()
        if not presence.available:
            return Availability(False, presence.reason, versions)
        mismatch = check_matrix(found)
        if mismatch:
            return Availability(False, mismatch, versions)
        return Availability(True, f"MindSpeed {found['mindspeed']} on {presence.reason}", versions)

    @classmethod
    def validate(cls, job: JobSpec) -> None:
        o = job.backend.options
        # Megatron's checks, except context parallelism: megatron-core's local attention cannot do
        # it, but MindSpeed provides it on the NPU (context_parallel_algo).
        super().validate(
            dataclasses.replace(job, backend=dataclasses.replace(job.backend, options=dataclasses.replace(o, cp=1)))
        )
        if o.optimization_level not in (0, 1, 2):
            raise SpecError("backend.optimization_level", f"must be 0, 1 or 2, got {o.optimization_level}")
        if o.reuse_fp32_param and job.run.precision != "bf16":
            raise SpecError("backend.reuse_fp32_param", "reusing fp32 params for bf16 copies needs run.precision=bf16")
        if o.cp > 1 and job.data.seq_len % (2 * o.cp):
            raise SpecError("backend.cp", f"data.seq_len={job.data.seq_len} is not divisible by 2 x cp = {2 * o.cp}")
        if o.visible_devices and len(o.visible_devices.split(",")) < job.launch.nproc_per_node:
            raise SpecError(
                "backend.visible_devices",
                f"{o.visible_devices!r} lists fewer NPUs than launcher.nproc_per_node={job.launch.nproc_per_node}",
            )

    @classmethod
    def launch_env(cls, job: JobSpec) -> dict[str, str]:
        env = dict(HCCL_ENV)
        visible = job.backend.options.visible_devices or ",".join(str(i) for i in range(job.launch.nproc_per_node))
        env["ASCEND_RT_VISIBLE_DEVICES"] = visible
        return env

    @classmethod
    def bundle_files(cls, job: JobSpec) -> dict[str, str]:
        return {"mindspeed_args.txt": "\n".join(mindspeed_argv(job)) + "\n"}

    @classmethod
    def worker_args(cls, job: JobSpec) -> list[str]:
        return mindspeed_argv(job)

    @classmethod
    def create_engine(cls, ctx: WorkerContext) -> Engine:
        # MindSpeed reads its switches from the command line when its adaptor is imported: the
        # launcher put them on this worker's command line (worker_args).
        missing = [a for a in mindspeed_argv(ctx.job) if a not in sys.argv]
        if missing:
            raise RuntimeError(
                f"MindSpeed reads its switches from sys.argv, which lacks {missing[:3]}: start the "
                "worker through the launcher (python -m parabench.worker RUN_DIR <mindspeed_args.txt>)"
            )
        import mindspeed.megatron_adaptor  # noqa: F401  (worker only: patches megatron-core, applies transfer_to_npu)

        return MegatronEngine(ctx, redirect_cuda=False)  # transfer_to_npu already maps CUDA onto the NPU
