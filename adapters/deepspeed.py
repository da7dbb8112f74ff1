"""DeepSpeed: ZeRO stages 0-3, optimizer/parameter offload, on the canonical Llama.

The DeepSpeed config is a pure function of the typed spec (:func:`deepspeed_config`), optionally
merged with a user's ``ds_config.json`` (``backend.config_file``). Keys the harness owns - batch
geometry, precision, clipping, the optimizer, the ZeRO stage and offload devices - may repeat the
harness's value in that file ("auto" also means "the harness's value"), but a different value is an
error before launch, never a silent override. Tuning knobs left null here (bucket sizes, ZeRO-3
prefetch/persistence) come from the file, else DeepSpeed's own defaults.

Optimizer: the client ``torch.optim.AdamW`` from ``make_adamw`` (same algorithm, hyper-parameters
and decay mask as ddp/fsdp), passed to ``deepspeed.initialize`` with
``zero_allow_untested_optimizer`` - DeepSpeed's own ``optimizer`` block would select FusedAdam or
cpu_adam, a different implementation (docs/sources.md#deepspeed-on-cpu). With ``offload_optimizer=cpu``
DeepSpeed insists on its ``DeepSpeedCPUAdam`` (``adamw_mode=True``, same groups and values);
``backend.offload_adam=torch`` keeps torch's AdamW there too (``zero_force_ds_cpu_optimizer:
false``), slower but exact.

Model states per rank (docs/sources.md#zero-model-states: Rajbhandari et al. 2019, ZeRO, arXiv 1910.02054,
sec. 3 and 5), with b bytes
per working parameter/gradient (2 for bf16/fp16, 4 for fp32) and K = 12 (fp32 master 4 + Adam
moments 8; DeepSpeed keeps a separate fp32 master in every ZeRO stage, fp32 training included):
stage 0: (b + b + K) Psi (fp32: no master, K = 8); stage 1: 2b Psi + K Psi/Nd; stage 2:
b Psi + (b + K) Psi/Nd; stage 3: (2b + K) Psi/Nd. Measured values come from the tensors DeepSpeed
holds (each storage counted once); flat-buffer alignment padding and ZeRO-3's persistent (small,
unpartitioned) parameters are reported in ``detail``.

Mixture-of-Experts (docs/moe.md#deepspeed): DeepSpeed-MoE's own layer with ``ep_size = backend.ep``
(:mod:`parabench.adapters.deepspeed_moe`), ZeRO 0-2; a rank then holds the non-expert parameters and
E / ep experts per layer, and ZeRO partitions the experts over the Nd / ep expert-data-parallel ranks.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from parabench.adapters.base import (
    Adapter,
    Availability,
    Capabilities,
    CheckpointSupport,
    ConvertSupport,
    StateFormula,
    WorkerContext,
)
from parabench.adapters.deepspeed_config import KNOBS, deepspeed_config, extensions_dir
from parabench.adapters.deepspeed_moe import (
    check_moe,
)
from parabench.adapters.deepspeed_profile import PROFILE
from parabench.adapters.deepspeed_states import zero_formula
from parabench.devices import ProbeFailed, resolve, run_probe
from parabench.errors import SpecError
from parabench.spec import MODEL_FEATURES, JobSpec

if TYPE_CHECKING:  # pragma: no cover
    from parabench.adapters.deepspeed_engine import DeepSpeedEngine

DS_VERSION = "0.19.8"  # the version the parity and state-bytes tests were written against


@dataclass(frozen=True)
class DeepSpeedOptions:
    zero_stage: Literal[0, 1, 2, 3] = 2
    offload_optimizer: Literal["none", "cpu"] = (
        "none"  # ZeRO-Offload: fp32 master + Adam states (and their step) on the host
    )
    offload_param: Literal["none", "cpu"] = "none"  # ZeRO-3 only: partitioned parameters on the host
    offload_pin_memory: bool = False
    offload_adam: Literal["cpu_adam", "torch"] = "cpu_adam"  # optimizer under offload_optimizer (see module doc)
    activation_checkpointing: bool = False
    # Mixture-of-Experts (docs/moe.md#deepspeed): DeepSpeed-MoE's ep_size, each expert-parallel rank
    # holding num_local_experts / ep experts of every layer; ep divides the world (megatron's name)
    ep: int = 1
    # Tuning knobs; null = from config_file if it sets them, else DeepSpeed's default (in brackets).
    reduce_bucket_size: int | None = None  # elements per gradient reduce bucket [5e8]
    allgather_bucket_size: int | None = None  # stage 1/2 parameter all-gather bucket [5e8]
    overlap_comm: bool | None = None  # [true for stage 3, false otherwise]
    contiguous_gradients: bool | None = None  # [true]
    stage3_prefetch_bucket_size: int | None = None  # [5e7]
    stage3_param_persistence_threshold: int | None = None  # params below this many elements stay whole [1e5]
    stage3_max_live_parameters: int | None = None  # [1e9]
    stage3_max_reuse_distance: int | None = None  # [1e9]
    config_file: str | None = None  # a user's ds_config.json, merged (conflicts are errors)
    extensions_dir: str | None = (
        None  # TORCH_EXTENSIONS_DIR for the JIT ops; null = ~/.cache/parabench/torch_extensions/<environment>
    )


# --------------------------------------------------------------------------------------------
# `bench env`: a subprocess probe (importing deepspeed takes ~10 s), cached per version.
# --------------------------------------------------------------------------------------------
_PROBE = r"""
import json, sys
sys.modules["mlflow"] = None  # as import_deepspeed: the autotuner's optional mlflow import costs seconds
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder.all_ops import ALL_OPS
from deepspeed.git_version_info import installed_ops
ops = {}
for name, builder in ALL_OPS.items():
    try:
        ops[name] = bool(builder.is_compatible(verbose=False))
    except Exception:
        ops[name] = False
print(json.dumps({"version": deepspeed.__version__, "accelerator": get_accelerator()._name,
                  "comm": get_accelerator().communication_backend_name(),
                  "buildable": sorted(n for n, ok in ops.items() if ok),
                  "not_buildable": sorted(n for n, ok in ops.items() if not ok),
                  "installed": sorted(n for n, ok in installed_ops.items() if ok)}))
"""


def _probe(accelerator: str) -> dict[str, Any]:
    version = importlib.metadata.version("deepspeed")
    torch_version = importlib.metadata.version("torch")
    cache = Path.home() / ".cache" / "parabench" / f"deepspeed-probe-{version}-torch{torch_version}-{accelerator}.json"
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    try:
        out = run_probe(_PROBE, 180, env={"DS_ACCELERATOR": accelerator})
    except ProbeFailed as exc:
        return {"error": f"import deepspeed failed: {str(exc)[:300]}"}
    result = json.loads(out.strip().splitlines()[-1])
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(result))
    return result


# --------------------------------------------------------------------------------------------
# The adapter (declarative, cheap to import).
# --------------------------------------------------------------------------------------------
class DeepSpeedAdapter(Adapter):
    name = "deepspeed"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda", "npu"}),
        precisions=frozenset({"fp32", "bf16", "fp16"}),
        shards_model_states=True,
        model_features=MODEL_FEATURES,
        moe=True,  # DeepSpeed-MoE's own layer with ep_size (backend.ep), ZeRO 0-2 (docs/moe.md#deepspeed)
        checkpoint=CheckpointSupport(
            format="deepspeed",
            async_save=(
                "DeepSpeed writes asynchronously only through its FastPersist writers (checkpoint.writer, "
                "the async_io op: libaio or GPUDirect Storage), which do not build on a CPU host; parabench "
                "does not wire them"
            ),
            # ZeRO files hold per-data-parallel-rank partitions: another world size needs DeepSpeed's
            # offline ds_to_universal.py conversion first (docs/resilience.md#deepspeed).
            reshard=frozenset(),
            options=frozenset({"zero_stage"}),  # stage 3 partitions parameters, 1/2 only optimizer states
        ),
        convert=ConvertSupport(),
    )
    Options = DeepSpeedOptions
    plan_profile = PROFILE
    distributions = ("torch", "deepspeed")

    @classmethod
    def availability(cls) -> Availability:
        if importlib.util.find_spec("deepspeed") is None:
            return Availability(
                False,
                f"deepspeed is not installed: pip install --no-build-isolation deepspeed=={DS_VERSION} "
                "(with your torch pinned in the same command)",
            )
        accelerator = resolve("auto")
        probe = _probe(accelerator)
        versions = {"deepspeed": importlib.metadata.version("deepspeed")}
        if "error" in probe:
            return Availability(False, probe["error"], versions)
        versions.update(
            {
                "accelerator": f"{probe['accelerator']} ({probe['comm']}; DS_ACCELERATOR={accelerator} set for workers)",
                "ops_buildable": ", ".join(probe["buildable"]) or "none",
                "ops_not_buildable": ", ".join(probe["not_buildable"]) or "none",
                "ops_prebuilt": ", ".join(probe["installed"]) or "none (JIT-built on first use)",
            }
        )
        return Availability(True, f"deepspeed {probe['version']}, accelerator {probe['accelerator']}", versions)

    @classmethod
    def validate(cls, job: JobSpec) -> None:
        o = job.backend.options
        if o.offload_optimizer != "none" and o.zero_stage == 0:
            raise SpecError(
                "backend.offload_optimizer",
                "offloading optimizer states needs ZeRO stage 1, 2 or 3 (backend.zero_stage=0)",
            )
        if o.offload_param != "none" and o.zero_stage != 3:
            raise SpecError(
                "backend.offload_param", f"offloading parameters needs ZeRO stage 3 (backend.zero_stage={o.zero_stage})"
            )
        for name in KNOBS:
            value = getattr(o, name)
            if (
                isinstance(value, int)
                and not isinstance(value, bool)
                and value < (1 if name == "reduce_bucket_size" else 0)
            ):
                raise SpecError(
                    f"backend.{name}", f"must be {'> 0' if name == 'reduce_bucket_size' else '>= 0'}, got {value}"
                )
        if job.run.precision == "fp16" and job.device.type == "cpu" and not _cpu_fp16_supported():
            raise SpecError(
                "run.precision",
                "DeepSpeed runs fp16 on a CPU only with AVX512-FP16/AMX-FP16 (this one has neither); use bf16 or fp32",
            )
        deepspeed_config(job)  # config-file conflicts, before launch
        check_moe(job, job.parallel.world_size)

    @classmethod
    def launch_env(cls, job: JobSpec) -> dict[str, str]:
        device = job.device.type if job.device.type != "auto" else "cpu"
        # The JIT-built ops (cpu_adam, shm comm) land in a stable cache: only the first run builds them,
        # inside create_engine, which the measured loop does not time.
        return {"DS_ACCELERATOR": device, "TORCH_EXTENSIONS_DIR": extensions_dir(job)}

    @classmethod
    def layout_words(cls, options: DeepSpeedOptions) -> list[str]:
        return [f"zero{options.zero_stage}"] + ([f"ep{options.ep}"] if options.ep > 1 else [])

    @classmethod
    def expected_model_state(cls, job: JobSpec) -> StateFormula:
        return zero_formula(job)

    @classmethod
    def create_engine(cls, ctx: WorkerContext) -> DeepSpeedEngine:
        from parabench.adapters.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(ctx)


def _cpu_fp16_supported() -> bool:
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
