"""bench/device/call.sh and pack.sh, the device-call helpers (DEVELOPERS.md), on the CPU: a call's steps keep to its
limit and its skip list, a failing or slow step leaves the others' results, and packs round-trip."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _call(tmp_path: Path, script: str, **env: str) -> str:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    body = f". {REPO}/bench/device/call.sh\n{script}\n"
    res = subprocess.run(["bash", "-c", body], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(out), "K3MK_DEVICE_DRY": "1", **env})  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_steps_run_skip_and_keep_their_output(tmp_path):
    log = _call(tmp_path, "step a echo alpha\nstep b sh -c 'echo beta; exit 3'\nstep c echo gamma", SKIP="c")
    assert "== a: rc=0" in log and "alpha" in log
    assert "== b: rc=3" in log and "beta" in log
    assert "== c: skipped (SKIP)" in log
    # on exit every output is in one file (the device tool brings back at most 8)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["results.tar.xz"]
    listing = subprocess.run(["tar", "tJf", str(tmp_path / "out" / "results.tar.xz")], capture_output=True, text=True).stdout.split()
    assert sorted(listing) == ["a.txt", "b.txt"]


def test_a_step_gets_only_what_is_left_and_none_start_near_the_limit(tmp_path):
    log = _call(tmp_path, "step cut sleep 5\nstep fast echo ok\nSECONDS=$((SECONDS + 27))\nstep late echo never",
                LIMIT="30", STEP_MIN="5", STEP_MAX="1")  # fmt: skip
    assert "== cut: rc=124 (timed out)" in log
    assert "== fast: rc=0" in log
    assert "== late: not started" in log


def test_pack_round_trips_and_names_a_missing_directory(tmp_path):
    repo = tmp_path / "repo"
    (repo / "bench" / "device").mkdir(parents=True)
    (repo / "bench" / "device" / "pack.sh").write_text((REPO / "bench" / "device" / "pack.sh").read_text())
    art = repo / "artifacts_dev" / "m_b1"
    (art / "ir_dump").mkdir(parents=True)
    (art / "manifest.json").write_text("{}")
    (art / "kernel.ptx").write_text("ptx")
    (art / "ir_dump" / "x").write_text("ir")
    ok = subprocess.run(["bash", "bench/device/pack.sh", "p", "m_b1"], cwd=repo, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    listing = subprocess.run(["tar", "tJf", str(repo / "pack" / "p.tar.xz")], capture_output=True, text=True).stdout.split()
    assert "m_b1/manifest.json" in listing and not [n for n in listing if n.endswith(".ptx") or "ir_" in n]
    bad = subprocess.run(["bash", "bench/device/pack.sh", "p", "nope"], cwd=repo, capture_output=True, text=True)
    assert bad.returncode == 1 and "artifacts_dev/nope does not exist" in bad.stderr
