# On the device machine: sourced by a device call's script, from the repository root (DEVELOPERS.md "GPU work from a
# machine without a GPU"):
#
#     . bench/device/call.sh [PACK ...]     # fla wheel, k3mk importable, pack/PACK.tar.xz unpacked into artifacts_dev/
#     step NAME COMMAND [ARG ...]           # COMMAND's output in $OUT/NAME.txt, its tail printed
#
# A call has one limit for everything (the device tool's timeout): `step` starts nothing once fewer than $STEP_MIN
# seconds (default 45) are left before $LIMIT (default 560) from the source, and gives COMMAND at most what is left
# ($STEP_MAX at most, default 200), so a slow step cannot take the results of the others with it. SKIP="NAME ..."
# leaves out the steps an earlier call ran (a warm machine keeps artifacts_dev/, so a second call may pass no PACK).
# The device tool brings back at most 8 files: when the script exits, everything under $OUT goes into
# $OUT/results.tar.xz. K3MK_DEVICE_DRY=1 skips the wheels, PYTHONPATH and nvidia-smi (its CPU test).
T0=$SECONDS
OUT=${OUT:?the device tool sets OUT}
export PYTHONUNBUFFERED=1

elapsed() { echo $((SECONDS - T0)); }

step() {
  local name=$1 left
  shift
  case " ${SKIP:-} " in *" $name "*) echo "== $name: skipped (SKIP)"; return 0;; esac
  left=$(( ${LIMIT:-560} - $(elapsed) ))
  if [ "$left" -le "${STEP_MIN:-45}" ]; then echo "== $name: not started, $(elapsed) s of ${LIMIT:-560} gone"; return 0; fi
  [ "$left" -gt "${STEP_MAX:-200}" ] && left=${STEP_MAX:-200}
  timeout "$left" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "== $name: rc=$rc$([ $rc = 124 ] && echo ' (timed out)') at $(elapsed) s"
  tail -n "${TAIL:-8}" "$OUT/$name.txt"
  return 0
}

pack_results() {
  local files
  files=$(cd "$OUT" && ls -A | grep -vx results.tar.xz)
  [ -n "$files" ] && (cd "$OUT" && tar cf - $files | xz -T4 -3 > results.tar.xz && rm -rf $files)
  return 0
}
trap pack_results EXIT

if [ -z "${K3MK_DEVICE_DRY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -n 2
  mkdir -p /tmp/site && ln -sfn "$PWD" /tmp/site/k3mk
  export PYTHONPATH=/tmp/site
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/gpu.txt"
fi
mkdir -p artifacts_dev
for p in "$@"; do xz -T8 -dc "pack/$p.tar.xz" | tar xf - -C artifacts_dev; done
echo "ready at $(elapsed) s"
