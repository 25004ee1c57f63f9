#!/usr/bin/env bash
# One GPU (issue #17): `k3mk generate --artifact` against the reference (--check: exit 0 means the
# megakernel's token equals the reference's at every step with a clear top-1 / top-2 gap), on k3-tiny and
# k3-proxy-16l at TP1; the CUDA IPC path with two processes on the one GPU; then, as a slow test of the
# whole one-process-per-GPU path, k3-tiny's TP2 artifact as two processes sharing GPU 0 (each collective
# waits for the GPU to switch processes: if it never does, the step deadline fails both ranks, naming them).
#
# Artifacts, built on the CPU machine (DEVELOPERS.md "GPU work from a machine without a GPU"):
#   python tests/runtime/build_model_artifacts.py model_k3-tiny_b1
#   python tests/runtime/build_tp_artifacts.py model_k3-tiny_b1_tp2
#   k3mk compile --model k3-proxy-16l --max-context 128 --arch sm_90a --out artifacts_dev/model_k3-proxy-16l_b1_ctx128
# There: k3mk importable (PYTHONPATH), then `bash tests/runtime/generate_artifact_gpu.sh [RUN ...]` (default:
# every run; the proxy takes most of a 10-minute call: run it alone); logs -> $OUT.
set -u
OUT=${OUT:-/tmp/generate_artifact_gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader >"$OUT/gpu.txt" 2>&1  # Exclusive_Process would refuse the second process
A=artifacts_dev
K3MK=(python -m k3mk.compiler.cli)

RUNS=" ${*:-tiny_tp1 proxy_tp1 ipc_one_gpu tiny_tp2_one_gpu} "

run() {  # name, limit in seconds, command...
  local name=$1 limit=$2
  shift 2
  [[ $RUNS == *" $name "* ]] || return 0
  echo "== $name: $*"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local status=$?
  echo "$name: exit $status in $((SECONDS - start)) s" | tee -a "$OUT/status.txt"
  cat "$OUT/$name.out"
  tail -n 6 "$OUT/$name.err"
}

run tiny_tp1 200 "${K3MK[@]}" generate --artifact $A/model_k3-tiny_b1 --random-weights 0 --prompt 17,4095,1234 --steps 48 --check
run proxy_tp1 240 "${K3MK[@]}" generate --artifact $A/model_k3-proxy-16l_b1_ctx128 --random-weights 0 --prompt 9000,17,123456 --steps 48 --check
run ipc_one_gpu 150 python -m pytest -m gpu -q -s tests/runtime/test_tp_ipc_gpu.py
run tiny_tp2_one_gpu 240 "${K3MK[@]}" generate --artifact $A/model_k3-tiny_b1_tp2 --random-weights 0 --prompt 17,4095,1234 --steps 16 --check \
  --gpus 0,0 --deadline 30 --setup-deadline 120
cat "$OUT/status.txt"
