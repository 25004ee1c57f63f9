#!/usr/bin/env bash
# On the CPU machine: pack artifacts for a device call (DEVELOPERS.md "GPU work from a machine without a GPU").
#
#     bash bench/device/pack.sh NAME DIR [DIR ...]
#
# writes pack/NAME.tar.xz (pack/ is git-ignored: pass it in the device call's carry, with .whl) of the artifact
# directories DIR (paths under artifacts_dev/), leaving out what the runtime does not read (schedule.txt, PTX, IR
# dumps); task tables compress ~50x, and a call carries at most 64 MiB.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ $# -ge 2 ] || { echo "usage: bash bench/device/pack.sh NAME DIR [DIR ...] (DIRs under artifacts_dev/)" >&2; exit 2; }
name=$1
shift
for d in "$@"; do
  [ -e "artifacts_dev/$d" ] || { echo "pack.sh: artifacts_dev/$d does not exist" >&2; exit 1; }
done
mkdir -p pack
tar cf - --exclude schedule.txt --exclude '*.ptx' --exclude 'ir_*' -C artifacts_dev "$@" | xz -T2 -3 > "pack/$name.tar.xz"
echo "pack/$name.tar.xz: $(du -h "pack/$name.tar.xz" | cut -f1)"
