#!/usr/bin/env bash
# First contact with a GPU: install parabench next to a preinstalled torch WITHOUT touching it, then
# run the CUDA paths once, each step under its own time limit, and leave the evidence in one folder.
#
#   benchmarks/gpu_check.sh [--device cuda|cpu] [--out DIR] [--wheels DIR] [--python PY] [--work DIR]
#
#   --device cuda   (default) the real check on one CUDA GPU: ~1.1B Llama (conf/model/tinyllama-1.1b),
#                   bf16, on ddp, fsdp, deepspeed ZeRO-2 and ZeRO-3, megatron (local spec; Transformer
#                   Engine only if installed); fp32 parity of the canonical `llama` on CUDA vs CPU.
#   --device cpu    the rehearsal on a machine without a GPU: the same steps on the tiny `llama` model;
#                   the "parity" step then compares CPU with CPU and says so. Every figure is CPU.
#   --wheels DIR    wheels of what the target lacks (made here by benchmarks/gpu_wheels.py); they are
#                   installed with --no-deps --no-index, so pip never resolves, downloads or replaces
#                   anything, torch included.
#   --out DIR       where the evidence goes (default: $OUT if set, else ./gpu-check-out):
#                   gpu_check.log (everything), steps.tsv (step, status, seconds), summaries.json (every
#                   run's summary.json), parity.json, report.md / report.html (bench compare), mlflow.db.
#
# The script never stops at a failed step: it records the failure (status and log tail) and goes on,
# so one run yields every figure that can be had. Its exit status is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

DEVICE=cuda; OUTDIR=${OUT:-$REPO/gpu-check-out}; WHEELS=""; PY=${PYTHON:-python3}; WORK=/tmp/parabench-gpu-check
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --out) OUTDIR=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    *) echo "gpu_check: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check: --device must be cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac
mkdir -p "$OUTDIR" "$WORK"
OUTDIR=$(cd "$OUTDIR" && pwd)
LOG=$OUTDIR/gpu_check.log; STEPS=$OUTDIR/steps.tsv
: >"$LOG"; printf 'step\tstatus\tseconds\n' >"$STEPS"
SITE=$WORK/site; RESULTS=$WORK/results; RUNS=$WORK/runs
rm -rf "$SITE" "$RESULTS" "$RUNS" "$WORK/results-parity-cpu"; mkdir -p "$SITE" "$RESULTS" "$RUNS"
FAILED=0
# torch_npu installed without CANN makes `import torch` fail; the harness sets this too.
export TORCH_DEVICE_BACKEND_AUTOLOAD=0 MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
BENCH=("$PY" -m parabench)

say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }

step() {  # step NAME TIMEOUT_S CMD...: run, log, record status and seconds; never exits the script
  # The command runs in its own process group, so a time-out also ends the ranks it started.
  local name=$1 limit=$2 t0 pid rc=0 status=ok; shift 2
  say "step $name (limit ${limit}s): $*"
  t0=$(date +%s)
  setsid "$@" >>"$LOG" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
    status="timeout(${limit}s)"
  fi
  wait "$pid"; rc=$?
  [ "$status" = ok ] && [ $rc -ne 0 ] && status="failed(rc=$rc)"
  [ "$status" = ok ] || FAILED=$((FAILED + 1))
  printf '%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" >>"$STEPS"
  say "step $name: $status in $(( $(date +%s) - t0 ))s"
}

torch_fingerprint() {  # version, RECORD hash, core library's inode + mtime: changes if pip touched torch
  "$PY" "$REPO/benchmarks/torch_fingerprint.py"
}

install() {
  local before after
  "$PY" -c "import torch" || { say "no importable torch for $PY: the check needs a preinstalled torch"; return 1; }
  before=$(torch_fingerprint) || return 1
  say "torch before install: $before"
  if [ -n "$WHEELS" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || return 1
  fi
  # --no-deps: nothing is resolved, so no dependency (torch above all) is installed or upgraded.
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" "$REPO" || return 1
  after=$(torch_fingerprint) || return 1
  say "torch after install:  $after"
  [ "$before" = "$after" ] || { say "torch changed during the install"; return 1; }
  "$PY" -c "import parabench, hydra, mlflow; print('parabench importable from', parabench.__file__)"
}

run_cmd() {  # run_cmd NAME RESULTS_DIR OVERRIDES...: sets CMD to one recorded run in $RUNS/NAME
  local name=$1 results=$2; shift 2
  CMD=("${BENCH[@]}" run "hydra.run.dir=$RUNS/$name" "run.results_dir=$results" tracking.experiment=gpu_check
       "run.name=$name" "$@")
}

if [ "$DEVICE" = cuda ]; then
  MODEL=tinyllama-1.1b; PRECISION=bf16
  BIG=(data.seq_len=2048 data.micro_batch_size=4 data.global_batch_size=8)
  PARITY_DEVICES=(cuda cpu)
else
  MODEL=llama; PRECISION=bf16
  BIG=(data.seq_len=256 data.micro_batch_size=2 data.global_batch_size=4)
  PARITY_DEVICES=(cpu cpu)  # rehearsal: both sides on the CPU, labelled as such in parity.json
fi
COMMON=("+model=$MODEL" "device=$DEVICE" "run.precision=$PRECISION" run.warmup_steps=2 run.steps=10 "${BIG[@]}")

say "parabench gpu_check: device=$DEVICE model=$MODEL python=$PY out=$OUTDIR"
say "installing (no time limit needed: --no-index never waits on a network)"
if install >>"$LOG" 2>&1; then printf 'install\tok\t-\n' >>"$STEPS"
else printf 'install\tfailed\t-\n' >>"$STEPS"; say "install failed: see $LOG"; exit 1; fi
step env 120 "${BENCH[@]}" env
# The CPU half of the parity check needs no GPU. With a GPU it runs in the background beside the
# GPU runs (time budget) on half the host's cores, so that the GPU runs' host threads keep the other
# half (their figures are taken with that neighbour: docs/gpu_check.md says so). In the CPU
# rehearsal everything shares the same cores, so it runs in turn instead.
# Its own MLflow store: two runs creating one new SQLite store at the same moment race in
# MLflow's schema migration (the store is made once, by the first run, for the rest).
run_cmd parity_b "$WORK/results-parity-cpu" +model=llama "device=${PARITY_DEVICES[1]}" run.precision=fp32 \
  run.warmup_steps=0 run.steps=11
PARITY_B=""
if [ "$DEVICE" = cuda ]; then
  step "parity_${PARITY_DEVICES[1]}_b" 300 "${CMD[@]}" "device.threads_per_rank=$(( $(nproc) / 2 ))" &
  PARITY_B=$!
else
  step "parity_${PARITY_DEVICES[1]}_b" 300 "${CMD[@]}"
fi
for variant in ddp fsdp deepspeed/zero2 deepspeed/zero3 megatron; do
  name=${variant//\//_}
  run_cmd "$name" "$RESULTS" "${COMMON[@]}" "backend=$variant"
  step "$name" 300 "${CMD[@]}"
done
run_cmd parity_a "$RESULTS" +model=llama "device=${PARITY_DEVICES[0]}" run.precision=fp32 run.warmup_steps=0 run.steps=11
step "parity_${PARITY_DEVICES[0]}_a" 240 "${CMD[@]}"
if [ -n "$PARITY_B" ]; then
  wait "$PARITY_B"
  # that step ran in a background subshell: its status is only in steps.tsv
  grep -q "^parity_${PARITY_DEVICES[1]}_b	ok" "$STEPS" || FAILED=$((FAILED + 1))
fi
step parity_check 60 "$PY" "$REPO/benchmarks/gpu_parity.py" "$RUNS/parity_a" "$RUNS/parity_b" \
  --labels "${PARITY_DEVICES[0]},${PARITY_DEVICES[1]}" --out "$OUTDIR/parity.json"
step compare 120 "${BENCH[@]}" compare --experiment gpu_check --tracking-uri "sqlite:///$RESULTS/mlflow.db" \
  --baseline backend=ddp --format md --out "$WORK/report" --no-log

# Evidence into the output folder (flat: at most 8 files come back from a device run).
"$PY" - "$RUNS" "$OUTDIR/summaries.json" <<'PY' >>"$LOG" 2>&1
import json, pathlib, sys
runs = pathlib.Path(sys.argv[1])
found = {p.parent.name: json.loads(p.read_text()) for p in sorted(runs.glob("*/summary.json"))}
pathlib.Path(sys.argv[2]).write_text(json.dumps(found, indent=1))
print(f"summaries of {len(found)} runs: {sorted(found)}")
PY
cp -f "$WORK/report/report.md" "$WORK/report/report.html" "$OUTDIR/" 2>/dev/null
cp -f "$RESULTS/mlflow.db" "$OUTDIR/" 2>/dev/null
say "done: $FAILED failed step(s); steps:"
tee -a "$LOG" <"$STEPS" >&2
exit "$FAILED"
