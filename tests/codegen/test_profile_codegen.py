"""Profile builds (KernelConfig.profile, `k3mk compile --profile`): profiling only ADDS lines to the kernel
source, so a release build's source is exactly what it was without the feature; a profile build compiles
for sm_90a with the timer reads in it; the whole k3-tiny profile artifact builds through the CLI."""

from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path

import pytest

from k3mk.codegen.emit import emit_source
from k3mk.codegen.ops import KernelConfig
from k3mk.runtime import abi

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from megakernel_cases import all_cases  # noqa: E402

CASES = ("chain", "diamond", "moe_graph_b4", "kda_layer_b4")


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_profiling_only_inserts_lines(case, debug):
    variants = all_cases()[case].builder.table().variants
    release = emit_source(variants, KernelConfig(debug=debug)).splitlines()
    profile = emit_source(variants, KernelConfig(debug=debug, profile=True)).splitlines()
    ops = difflib.SequenceMatcher(a=release, b=profile, autojunk=False).get_opcodes()
    assert {tag for tag, *_ in ops} == {"equal", "insert"}, [op for op in ops if op[0] not in ("equal", "insert")]
    added = [line for tag, _, _, j1, j2 in ops if tag == "insert" for line in profile[j1:j2]]
    # consumers: start, wait_done, body_end, and inside a streaming body staged, first fill, last release and around
    # each acquire (warp 0's fill wait) (ring.py.j2); the producer: produce_start, produce_end, and around its ring waits
    assert sum("cute.arch.globaltimer()" in line for line in added) == 12
    release_text = "\n".join(release)
    assert "PROFILE" not in release_text and "record[P_" not in release_text
    if not debug:
        assert "globaltimer" not in release_text and "cute.arch.smid()" not in release_text


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3MK_CACHE_DIR", str(tmp_path / "cache"))


def test_profile_build_compiles(tmp_path, cache):
    pytest.importorskip("cutlass", reason="compiling needs nvidia-cutlass-dsl (the compile extra)")
    from k3mk.codegen.build import build
    from k3mk.runtime.manifest import load_manifest

    out = build(all_cases()["diamond"].builder.table(), tmp_path / "diamond", config=KernelConfig(profile=True))
    m = load_manifest(out)  # checks the "1+profile" ABI against this runtime
    assert m["profile"] is True and m["debug"] is False and m["abi_version"] == abi.PROFILE_ABI_VERSION
    assert (m["profile_words_per_task"], m["profile_ring_steps"]) == (abi.PROFILE_WORDS, abi.PROFILE_RING_STEPS)
    assert m["params"] == abi.params_json()  # the same kernel parameters as a release build
    ptx = m.file("ptx").read_text()
    assert ptx.count("%globaltimer;") >= 5 and "%smid;" in ptx
    # the body_end stamp comes before the release add (no waiter sees the signal earlier than the stamp)
    release = ptx.index("red.release.gpu.global.add.u64")
    assert ptx.rindex("%globaltimer;", 0, release) > ptx.rindex("bar.sync", 0, release)


def test_k3_tiny_profile_artifact(tmp_path, capsys):
    """`k3mk compile --profile`: the whole k3-tiny step compiles to an sm_90a cubin (cached by source after
    the first build) with the cost model's bytes per task beside it."""
    pytest.importorskip("cutlass")
    from k3mk.compiler.cli import main
    from k3mk.runtime.manifest import load_manifest
    from k3mk.runtime.profile import TASK_BYTES_FILE
    from k3mk.runtime.table import read_table

    out = tmp_path / "art"
    assert main(["compile", "--model", "k3-tiny", "--max-context", "64", "--arch", "sm_90a", "--profile", "--out", str(out)]) == 0
    m = load_manifest(out)
    assert m["profile"] is True and m["abi_version"] == abi.PROFILE_ABI_VERSION
    assert m.read_file("cubin")[:4] == b"\x7fELF" and "%globaltimer;" in m.file("ptx").read_text()
    task_bytes = json.loads(m.read_file(TASK_BYTES_FILE))
    num_tasks = read_table(m.read_file("task_table")).num_tasks
    assert len(task_bytes["weight_bytes"]) == len(task_bytes["other_bytes"]) == num_tasks == m["num_tasks"]
    assert sum(task_bytes["weight_bytes"]) > 0


def test_profile_needs_out(capsys):
    from k3mk.compiler.cli import main

    assert main(["compile", "--model", "k3-tiny", "--profile"]) == 2
    assert "--profile applies to the artifact build: give --out" in capsys.readouterr().err
