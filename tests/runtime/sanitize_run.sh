#!/bin/bash
# Device-side driver for docs/megakernel.md "Sanitizers and graph replay": the 1,000-step graph-replay test,
# then compute-sanitizer memcheck / racecheck / synccheck (+ initcheck) on short k3-tiny runs, release and
# debug builds, in parallel (one GPU, separate processes; --launch-timeout 0: 7 processes importing torch at
# once took longer than the default 10 s to reach cuInit, and the tool then never attached). Logs -> $OUT (default /tmp/k3mk_sanitize).
# Needs artifacts_dev/model_k3-tiny_b{1,4} and model_k3-tiny_b1_debug; k3mk importable. Every error is printed
# (--print-limit, default 1000); SAN_EXTRA adds options, e.g. SAN_EXTRA='--report-api-errors no' keeps only device errors.
OUT=${OUT:-/tmp/k3mk_sanitize}; mkdir -p "$OUT"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /usr/local/cuda*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; echo "sanitizer: $CS"; "$CS" --version;
  python -c "import torch, cuda; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } > "$OUT/env.txt" 2>&1
S=tests/runtime/sanitize_model.py
san() {  # name tool steps artifact timeout
  local t0=$(date +%s)
  timeout "$5" "$CS" --tool "$2" --launch-timeout 0 --print-limit "${PRINT_LIMIT:-1000}" $SAN_EXTRA python "$S" --steps "$3" --artifact "$4" > "$OUT/$1.log" 2>&1
  echo "rc=$? wall_s=$(( $(date +%s) - t0 ))" >> "$OUT/$1.log"
}
t0=$(date +%s)
if [ -z "$SKIP_REPLAY" ]; then  # (rc is pytest's: an `a || b` line would report the test's status)
  timeout "${REPLAY_TIMEOUT:-110}" python -m pytest -m gpu tests/runtime/test_model_replay_gpu.py -q -s -p no:cacheprovider > "$OUT/replay.log" 2>&1
  echo "rc=$? wall_s=$(( $(date +%s) - t0 ))" >> "$OUT/replay.log"
fi
T=${SAN_TIMEOUT:-170}
R=model_k3-tiny_b1; D=model_k3-tiny_b1_debug
san memcheck_release memcheck 3 $R $T &
san racecheck_release racecheck 1 $R $T &
san synccheck_release synccheck 1 $R $T &
[ -z "$INITCHECK" ] || san initcheck_release initcheck 1 $R $T &
san memcheck_debug memcheck 2 $D $T &
san racecheck_debug racecheck 1 $D $T &
san synccheck_debug synccheck 1 $D $T &
wait
grep -H -E "ERROR SUMMARY|RACECHECK SUMMARY|rc=|step [0-9]|epoch" "$OUT"/*.log > "$OUT/summary.txt"
cat "$OUT/summary.txt"
