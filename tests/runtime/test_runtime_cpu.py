"""The runtime without a GPU: it imports no compiler package, its task-table reader agrees with
k3mk.ir.task_table, and manifests are checked against a device with clear errors."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from k3mk.ir import task_table as tt
from k3mk.runtime import abi, table
from k3mk.runtime.manifest import ArtifactError, Manifest, check_device, check_versions

sys.path.insert(0, str(Path(__file__).parent))
from megakernel_cases import all_cases  # noqa: E402


def test_runtime_imports_no_compiler_package():
    script = textwrap.dedent(
        """
        import importlib.abc, sys
        BLOCKED = ("cutlass", "k3mk.compiler", "k3mk.ir", "k3mk.passes", "k3mk.codegen", "jinja2", "networkx")
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                    raise ImportError(f"the runtime imported {name}")
        sys.meta_path.insert(0, Block())
        import k3mk.runtime
        from k3mk.runtime import Megakernel, WatchdogError, load_manifest
        import k3mk.runtime.profile
        import k3mk.runtime.engine_contract
        loaded = [m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED)]
        assert not loaded, loaded
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_reader_constants_agree_with_the_format():
    assert (table.FORMAT_VERSION, table.MAGIC, table.HEADER_WORDS, table.TASK_WORDS) == (
        tt.FORMAT_VERSION, tt.MAGIC, tt.HEADER_WORDS, tt.TASK_WORDS)  # fmt: skip
    for name in ("H_MAGIC", "H_VERSION", "H_HEADER_WORDS", "H_TASK_WORDS", "H_NUM_LISTS", "H_NUM_TASKS", "H_NUM_EVENTS",
                 "H_NUM_VARIANTS", "H_LISTS_OFFSET", "H_TASKS_OFFSET", "H_EVENTS_OFFSET", "H_DEVICE_WORDS", "H_META_BYTES",
                 "W_OPCODE", "W_WAIT0", "W_COUNT0", "W_WAIT1", "W_COUNT1", "W_SIGNAL", "W_WEIGHT_WAIT", "W_WEIGHT_COUNT", "NO_EVENT"):  # fmt: skip
        assert getattr(table, name) == getattr(tt, name), name


def test_reader_reads_an_encoded_table():
    case = all_cases()["diamond"]
    data = case.builder.table().encode()
    loaded = table.read_table(data)
    device, lists_offset, tasks_offset = tt.device_part(data)
    assert (loaded.device_bytes, loaded.lists_offset, loaded.tasks_offset) == (device, lists_offset, tasks_offset)
    assert (loaded.num_lists, loaded.num_events) == (8, 5)
    assert loaded.label(0, 0) == "norm[0]" and loaded.event_name(1) == "gemv_a"
    with pytest.raises(table.TaskTableFormatError, match="format 4"):
        table.read_table(data[:4] + (4).to_bytes(4, "little") + data[8:])


@pytest.mark.parametrize("name", sorted(all_cases()))
def test_reader_accepts_every_case_table(name):
    """The runtime's own structural check (no ir imports) agrees with the compiler's on every op case's table,
    router tiles counting their arrivals included."""
    case = all_cases()[name]
    loaded = table.read_table(case.builder.table().encode(check=case.check))
    assert loaded.num_tasks == case.builder.table().num_tasks


def manifest(**changes) -> Manifest:
    data = {
        "manifest_version": 1, "abi_version": abi.ABI_VERSION, "task_table_format": tt.FORMAT_VERSION,
        "params": abi.params_json(), "control_words": abi.CONTROL_WORDS, "debug_words_per_cta": abi.DEBUG_WORDS,
        "arch": "sm_90a", "compute_capability": [9, 0], "num_ctas": 132,
    }  # fmt: skip
    data.update(changes)
    return Manifest(Path("/nowhere"), copy.deepcopy(data))


def test_manifest_checks():
    check_versions(manifest())
    check_device(manifest(), (9, 0), 132)
    with pytest.raises(ArtifactError, match=r"built for sm_90a .* compute capability \(10, 0\) \(sm_100a\)"):
        check_device(manifest(), (10, 0), 148, "B200")
    with pytest.raises(ArtifactError, match="needs 132 co-resident CTAs .* has 114 SMs"):
        check_device(manifest(), (9, 0), 114)
    with pytest.raises(ArtifactError, match="task table format 4"):
        check_versions(manifest(task_table_format=4))
    with pytest.raises(ArtifactError, match="parameter ABI"):
        check_versions(manifest(params=abi.params_json()[:-1]))
    with pytest.raises(ArtifactError, match="manifest version 7"):
        check_versions(manifest(manifest_version=7))


def test_manifest_checks_profile_builds():
    """A profile build says ABI "1+profile" (a runtime without profiles refuses it: its `debug` buffer
    would be too short); artifacts from before profile builds (no "profile" key) still load."""
    check_versions(manifest())  # no "profile" key: built before profile builds
    check_versions(manifest(profile=False))
    profile = dict(profile=True, abi_version=abi.PROFILE_ABI_VERSION, profile_words_per_task=abi.PROFILE_WORDS,
                   profile_ring_steps=abi.PROFILE_RING_STEPS)  # fmt: skip
    check_versions(manifest(**profile))
    assert abi.PROFILE_ABI_VERSION == "1+profile"
    with pytest.raises(ArtifactError, match=r"parameter ABI 1\+profile .* differs from this runtime's 1 "):
        check_versions(manifest(abi_version=abi.PROFILE_ABI_VERSION))  # the flag is missing
    with pytest.raises(ArtifactError, match=r"parameter ABI 1 .* runtime's 1\+profile"):
        check_versions(manifest(**{**profile, "abi_version": abi.ABI_VERSION}))
    with pytest.raises(ArtifactError, match="profile record layout"):
        check_versions(manifest(**{**profile, "profile_words_per_task": abi.PROFILE_WORDS + 1}))


def test_watchdog_report_names_ring_waits():
    """A debug build's ring watchdog record (status STATUS_RING_TIMED_OUT: the barrier's smem byte offset,
    the parity, the fill or record index) is reported as what was waited for, from the manifest's ring;
    an event wait as before. No GPU: the records are written by hand."""
    import torch

    from k3mk.runtime.megakernel import Megakernel, WatchdogError

    loaded = table.read_table(all_cases()["diamond"].builder.table().encode())
    mk = object.__new__(Megakernel)
    mk.table, mk.num_ctas = loaded, 3
    mk.manifest = Manifest(Path("."), {"ring": {"slots": 4, "slot_bytes": 16384, "records": 2, "barrier_offset": 1000}})
    mk.control = torch.zeros(abi.CONTROL_WORDS, dtype=torch.int64)
    mk.control[abi.C_ABORT] = 1
    records = torch.zeros(3, abi.DEBUG_WORDS, dtype=torch.int64)
    # CTA 0: its producer waited for a free slot for fill 9 (slot 1's empty barrier: 1000 + 8 * (4 + 1))
    records[0] = torch.tensor([abi.STATUS_RING_TIMED_OUT, 17, -1, 1000 + 8 * 5, 1, 9, 2, -1])
    # CTA 2: its consumers waited for the record of task 3 (record slot 1's full barrier: 1000 + 8 * (8 + 1))
    records[2] = torch.tensor([abi.STATUS_RING_TIMED_OUT, 40, -1, 1000 + 8 * 9, 0, 3, 2, -1])
    mk.debug_records = records.flatten()
    with pytest.raises(WatchdogError) as e:
        mk.check()
    text = str(e.value)
    assert "CTA 0 (SM 17) timed out in its streaming ring: the producer waiting for a free slot for fill 9 (barrier at smem byte 1040)" in text
    assert "CTA 2 (SM 40) timed out in its streaming ring: the consumers waiting for the record of task 3" in text
    assert [r["cta"] for r in e.value.records] == [0, 2]


def test_mxfp4_scales_past_the_decode_limit_are_refused():
    """bind_weights' MXFP4 scale check: bytes up to abi.MXFP4_MAX_SCALE pass, a larger one is an error naming the
    tensor, the byte and how many exceed the limit."""
    import torch

    from k3mk.runtime.megakernel import _check_mxfp4_scales

    scales = torch.randint(0, abi.MXFP4_MAX_SCALE + 1, (3, 8, 16), dtype=torch.uint8)
    _check_mxfp4_scales("model.layers.1.mlp.experts.w2.weight_scale", scales)
    scales[1, 2, 3], scales[2, 0, 0] = abi.MXFP4_MAX_SCALE + 2, abi.MXFP4_MAX_SCALE + 1
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.experts.w2.weight_scale': MXFP4 scale byte 138 \(2\^11; 2 byte"):
        _check_mxfp4_scales("model.layers.1.mlp.experts.w2.weight_scale", scales)
