#!/usr/bin/env bash
# The compatibility matrix, tested (README "Compatibility"). Slow jobs, outside the repo's .venv:
#
#   benchmarks/compat_matrix.sh oldest      Python 3.10 + the oldest supported torch (2.6.0, CUDA build
#                                           from PyPI, runs on CPU) + megatron-core 0.12.1 (MindSpeed's
#                                           pin) + deepspeed 0.16.9 + the hf extra's lower bounds; installs
#                                           parabench there (torch must stay untouched) and runs the
#                                           deepspeed and megatron parity tests (fsdp on CPU: refused,
#                                           needs torch 2.7).  ~3 GB, 15-30 min
#   benchmarks/compat_matrix.sh known-good  the same with torch 2.7.1 (MindSpeed's known-good torch next
#                                           to megatron-core 0.12.1): ddp/fsdp and megatron parity tests
#   benchmarks/compat_matrix.sh keep-torch  Python 3.11 + the newest torch release on PyPI (a CUDA build,
#                                           ~5 GB; KEEP_TORCH=X.Y.Z picks another): `pip install .` must
#                                           leave that torch in place; then `bench run +model=llama` and
#                                           2-rank ddp and fsdp runs.  ~5 min once downloaded
#   benchmarks/compat_matrix.sh keep-torch-env  its install alone (keep-torch repeats the check, then runs)
#   benchmarks/compat_matrix.sh static      Python 3.12 and 3.10: byte-compile every source file and check
#                                           that pip accepts the package metadata (requires-python).  <1 min
#   benchmarks/compat_matrix.sh all         the three, in that order
#
# Environment: COMPAT_ROOT (default /work/venvs) holds the venvs; PY310, PY311, PY312 name the
# interpreters (default: pyenv's 3.10.13 / 3.11.7 / 3.12.1, else python3.X on PATH). Needs PyPI.
# Heavy steps take /tmp/pb-heavy.lock, so only one torchrun job runs at a time on a shared machine.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="${COMPAT_ROOT:-/work/venvs}"
LOCK=/tmp/pb-heavy.lock

interp() {  # $1: 3.10 / 3.11 / 3.12 -> a path to that interpreter
  local var="PY${1/./}" p
  for p in "${!var:-}" /root/.pyenv/versions/"$1".*/bin/python"$1" "python$1"; do
    if [ -n "$p" ] && command -v "$p" >/dev/null 2>&1; then echo "$p"; return 0; fi
  done
  echo "compat_matrix: no Python $1 (set $var)" >&2; return 1
}

pipq() {  # $1 venv, then pip install arguments; pip's own output minus the local-index noise
  local log rc=0; log="$(mktemp)"
  "$1/bin/python" -m pip install -q --disable-pip-version-check "${@:2}" >"$log" 2>&1 || rc=$?
  grep -v "^WARNING: Location" "$log" || true
  return "$rc"
}

# torch's identity without importing it (benchmarks/torch_fingerprint.py, shared with gpu_check.sh).
fingerprint() { "$1/bin/python" "$REPO/benchmarks/torch_fingerprint.py"; }

# $1 venv, $2 python, $3 torch requirement: a venv holding that torch (kept if it is already there)
venv_with_torch() {
  [ -x "$1/bin/python" ] || "$2" -m venv "$1"
  if ! "$1/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch') != '${3#torch==}')" 2>/dev/null; then
    echo "[compat] $1: installing $3 (first time: downloads ~3 GB)"
    pipq "$1" "$3" "setuptools>=68" wheel
  fi
}

# $1 venv, $2 torch fingerprint before: parabench's install must not have touched torch
assert_torch_kept() {
  local after; after="$(fingerprint "$1")"
  if [ "$after" != "$2" ]; then echo "[compat] FAIL: torch changed: before '$2', after '$after'" >&2; exit 1; fi
  echo "[compat] torch untouched: $after"
}

# $1 venv, $2 python version, $3 torch version: torch first, then deepspeed, megatron-core and
# parabench's extras around it; parabench's install must leave that torch untouched.
matrix_env() {
  local venv="$1" before
  venv_with_torch "$venv" "$(interp "$2")" "torch==$3"
  before="$(fingerprint "$venv")"
  # deepspeed ships a source archive whose build imports torch: build it against this torch.
  pipq "$venv" --no-build-isolation "deepspeed==0.16.9" "safetensors==0.4.3" "tokenizers==0.21.4" einops
  # megatron-core 0.12.x wheels declare nvidia-modelopt[torch], wandb, tensorstore, ... (pip backtracks
  # through dozens of modelopt releases for >10 min): install it without them, as MindSpeed does.
  pipq "$venv" --no-deps "megatron-core==0.12.1"
  pipq "$venv" --no-build-isolation "$REPO[test,hf,deepspeed]"
  assert_torch_kept "$venv" "$before"
  "$venv/bin/bench" env
}

matrix_tests() {  # $1 venv, then pytest node ids (run from the repository, against the installed copy)
  cd "$REPO"
  flock "$LOCK" timeout 3600 "$1/bin/python" -m pytest -q -p no:cacheprovider "${@:2}"
}

# torch 2.6.0: deepspeed and megatron parity with ddp; fsdp on CPU is refused there (needs torch 2.7).
oldest() {
  matrix_env "$ROOT/compat" 3.10 2.6.0
  matrix_tests "$ROOT/compat" tests/test_versions.py \
    "tests/test_deepspeed.py::test_fp32_loss_parity_with_ddp" \
    "tests/test_deepspeed.py::test_optimizer_state_bytes_equal_the_zero_formula_on_two_ranks" \
    "tests/test_megatron.py::test_megatron_matches_ddp" "tests/test_megatron.py::test_megatron_metrics"
}

# torch 2.7.1 + megatron-core 0.12.1: MindSpeed's known-good pair (no NPU here); ddp/fsdp parity.
known_good() {
  matrix_env "$ROOT/torch27" 3.10 2.7.1
  matrix_tests "$ROOT/torch27" tests/test_versions.py \
    "tests/test_e2e.py::test_identical_initial_weights_for_every_backend_and_world_size" \
    "tests/test_e2e.py::test_ddp_fsdp_loss_parity" "tests/test_e2e.py::test_world_size_does_not_change_the_math" \
    "tests/test_e2e.py::test_exact_model_state_accounting" \
    "tests/test_megatron.py::test_megatron_matches_ddp" "tests/test_megatron.py::test_megatron_metrics"
}

newest_torch() {  # the newest torch release the package index offers
  local v
  v="$("$(interp 3.11)" -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\(.*\))$/\1/p')"
  [ -n "$v" ] || { echo "compat_matrix: cannot read torch's releases from the package index" >&2; return 1; }
  echo "$v"
}

KEEP_TORCH_VENV="$ROOT/keeptorch"

# The newest torch, then `pip install .` beside it (which must leave that torch in place): the slow part
# of keep-torch (a ~5 GB download the first time), on its own so CI can start it before its test tier.
keep_torch_env() {
  local venv="$KEEP_TORCH_VENV" before torch
  # A machine-wide pip constraint (some images cap torch to the wheels on their disk) must not decide
  # which torch this job tests, nor make pip replace it while installing parabench.
  export PIP_CONFIG_FILE=/dev/null
  torch="${KEEP_TORCH:-$(newest_torch)}"
  echo "[compat] keep-torch: torch $torch"
  venv_with_torch "$venv" "$(interp 3.11)" "torch==$torch"
  before="$(fingerprint "$venv")"
  pipq "$venv" "$REPO"  # plain `pip install .`: what a user on a GPU image types
  assert_torch_kept "$venv" "$before"
}

keep_torch() {
  local venv="$KEEP_TORCH_VENV" out
  keep_torch_env
  out="$(mktemp -d)"
  cd "$out"
  flock "$LOCK" bash -c "set -e
    '$venv/bin/bench' run +model=llama run.results_dir='$out/main'
    '$venv/bin/bench' run +model=llama backend=ddp launcher.nproc_per_node=2 run.steps=4 run.results_dir='$out/ddp2'
    '$venv/bin/bench' run +model=llama backend=fsdp launcher.nproc_per_node=2 run.steps=4 run.results_dir='$out/fsdp2'"
  echo "[compat] keep-torch: torch $(fingerprint "$venv" | cut -d' ' -f1) kept; main, ddp x2 and fsdp x2 runs finished (results in $out)"
}

static() {
  local v py
  for v in 3.10 3.12; do
    py="$(interp "$v")"
    # (the migrate fixtures hold deliberately unparseable Python 2 files)
    "$py" -m compileall -q -f -x '/tests/migrate/(fixtures|golden)/' "$REPO/bench" "$REPO/adapters" "$REPO/migrate" \
      "$REPO/tests" "$REPO/benchmarks"
    # metadata only (no dependencies): pip refuses the package when requires-python excludes $v
    "$py" -m pip install -q --disable-pip-version-check --dry-run --no-deps --ignore-installed "$REPO" \
      2> >(grep -v "^WARNING: Location" >&2)
    echo "[compat] static: Python $("$py" -c 'import platform; print(platform.python_version())'): every file compiles, pip accepts the metadata"
  done
}

case "${1:-}" in
  oldest) oldest ;;
  known-good) known_good ;;
  keep-torch) keep_torch ;;
  keep-torch-env) keep_torch_env ;;
  static) static ;;
  all) static; keep_torch; oldest; known_good ;;
  *) sed -n '2,22p' "$0"; exit 2 ;;
esac
