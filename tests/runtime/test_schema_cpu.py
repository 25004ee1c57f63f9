"""The artifact schema without a GPU: a complete manifest loads; every missing, mistyped or
inconsistent field, every unhashed or escaping file and every structurally broken task table (even one
whose hash matches) is ONE clear ArtifactError before any GPU work; without a GPU the runtime says so
after validating."""

from __future__ import annotations

import hashlib
import json
import random
import struct
import sys
from pathlib import Path

import pytest
import torch

from k3mk.ir import task_table as tt
from k3mk.passes.manager import ARCHS as TARGET_ARCHS
from k3mk.runtime import schema
from k3mk.runtime.manifest import ArtifactError, load_manifest
from k3mk.runtime.megakernel import DTYPES, Megakernel, NoDeviceError, load_artifact

sys.path.insert(0, str(Path(__file__).parent))
from fake_artifact import edit_manifest, fake_artifact, model_meta  # noqa: E402


@pytest.fixture()
def art(tmp_path):
    return fake_artifact(tmp_path / "art", meta=model_meta(max_tokens=4, max_context=96))


def refused(artifact: Path, *fragments: str) -> str:
    with pytest.raises(ArtifactError) as info:
        load_artifact(artifact)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_complete_artifact_loads(art):
    m, table = load_artifact(art)
    m.check_files()
    assert m["max_tokens"] == 4 and table.num_lists == m["num_ctas"] == 8
    assert set(m["files"]) == set(m["files_sha256"]) == {"cubin", "task_table", "source", "ptx"}


def test_every_build_field_is_required(tmp_path):
    fields = sorted(schema.BUILD_FIELDS) + sorted(schema.MODEL_FIELDS)
    for i, field in enumerate(random.Random(7).sample(fields, 12)):
        art = fake_artifact(tmp_path / f"art{i}", meta=model_meta())
        edit_manifest(art, lambda m: m.pop(field))
        if field == "model":  # the field that makes it a whole-model manifest: the others are then out of place
            refused(art, "belongs to whole-model artifacts, which this manifest does not describe")
        else:
            refused(art, f"field '{field}'", "is missing" if field in schema.BUILD_FIELDS else "every manifest of whole-model artifacts has it")


@pytest.mark.parametrize(
    "change, fragments",
    [
        (dict(num_ctas="8"), ("field 'num_ctas'", "expected an integer >= 1", "'8'")),
        (dict(arch="sm_89"), ("field 'arch'", "one of sm_90a, sm_100a, sm_103a", "'sm_89'")),
        (dict(compute_capability=[10, 0]), ("compute_capability", "[9, 0] for sm_90a", "[10, 0]")),
        (dict(num_ctas=500), ("num_ctas", "500 task lists exceed sm_count 132")),
        (dict(dynamic_smem_bytes=300000), ("dynamic_smem_bytes", "300000 exceeds the 232448 B of sm_90a")),
        (dict(block_threads=100), ("block_threads", "multiple of 32", "100")),
        (dict(debug="no"), ("field 'debug'", "true or false")),
        (dict(max_tokens=0), ("field 'max_tokens'", ">= 1", "0")),
        (dict(predicted_step_s=float("nan")), ("predicted_step_s", "a finite number")),
        (dict(weight_format="fp8"), ("weight_format", "bfloat16, mxfp4")),
        (dict(extra_field=1), ("field 'extra_field' is not part of manifest version 1",)),
        (dict(manifest_version=2), ("manifest version 2; this k3mk reads version 1",)),
        (dict(profile_ring_steps=4), ("'profile_ring_steps' belongs to profile builds",)),
        (dict(profile=True), ("field 'profile_words_per_task' is missing",)),
    ],
)
def test_mistyped_or_inconsistent_fields(art, change, fragments):
    edit_manifest(art, lambda m: m.update(change))
    refused(art, "manifest.json: ", *fragments)


def test_nested_records_are_checked(art):
    edit_manifest(art, lambda m: m["weights"][1].update(dtype="float8"))
    refused(art, "field 'weights[1].dtype'", "expected one of bfloat16")
    edit_manifest(art, lambda m: m["weights"][1].update(dtype="bfloat16") or m["buffers"][2].update(offset=m["arena_bytes"]))
    refused(art, "field 'buffers'", "beyond arena_bytes")


@pytest.mark.parametrize(
    "change, fragments",
    [
        (lambda m: m.pop("files_sha256"), ("field 'files_sha256' is missing",)),
        (lambda m: m["files_sha256"].pop("ptx"), ("field 'files_sha256.ptx' is missing", "every file listed is listed with its hash")),
        (lambda m: m["files"].update(ptx="../outside.ptx"), ("field 'files.ptx'", "a file name inside the artifact directory", "'../outside.ptx'")),
        (lambda m: m["files"].update(ptx="/etc/hostname"), ("field 'files.ptx'", "a file name inside the artifact directory")),
        (lambda m: m["files"].pop("source") and m["files_sha256"].pop("source"), ("field 'files.source' is missing",)),
        (lambda m: m["files_sha256"].update(extra="0" * 64), ("'files_sha256.extra' hashes a file that 'files' does not list",)),
    ],
)
def test_files_need_hashes_and_stay_inside(art, change, fragments):
    edit_manifest(art, change)
    refused(art, *fragments)


def test_a_tampered_or_escaping_file_is_refused(art, tmp_path):
    m = load_manifest(art)
    ptx = m.file("ptx")
    ptx.write_text(ptx.read_text() + "// edited\n")
    with pytest.raises(ArtifactError, match="megakernel.sm_90a.ptx does not match the hash in its manifest"):
        load_manifest(art).check_files()
    outside = tmp_path / "elsewhere.ptx"
    outside.write_text(".target sm_90a\n")
    ptx.unlink()
    ptx.symlink_to(outside)
    with pytest.raises(ArtifactError, match="ptx is missing \\(or not a regular file\\)"):
        load_manifest(art).check_files()


def test_malformed_manifest_is_one_error(art):
    (art / "manifest.json").write_text('{"manifest_version": 1, "arch": ')
    message = refused(art, "manifest.json: not a readable JSON manifest")
    assert "\n" not in message
    (art / "manifest.json").write_text("[1, 2]")
    refused(art, "expected a JSON object, found list")
    (art / "manifest.json").unlink()
    refused(art, "has no manifest.json: not a k3mk artifact")


def _rewrite_table(art: Path, change) -> None:
    """Change the task table's words and record the new hash: structure, not the hash, must catch it."""
    path = art / "task_table.bin"
    data = bytearray(path.read_bytes())
    change(data)
    path.write_bytes(bytes(data))
    edit_manifest(art, lambda m: m["files_sha256"].update(task_table=hashlib.sha256(bytes(data)).hexdigest()))


def _word(data: bytearray, index: int, value: int | None = None) -> int:
    if value is not None:
        struct.pack_into("<i", data, 4 * index, value)
    return struct.unpack_from("<i", data, 4 * index)[0]


def _task_word(data: bytearray, task: int, word: int) -> int:
    """The index of word `word` of task `task`."""
    return _word(data, tt.H_TASKS_OFFSET) + task * tt.TASK_WORDS + word


@pytest.mark.parametrize(
    "corrupt, fragments",
    [
        (lambda d, t, rng: _word(d, _task_word(d, t, tt.W_OPCODE), rng.randint(5, 999)), ("opcode", "is not one of the 4 variants")),
        (lambda d, t, rng: _word(d, _task_word(d, t, tt.W_SIGNAL), rng.randint(5, 999)), ("signals event", "outside 0..4")),
        (lambda d, t, rng: _word(d, _task_word(d, t, tt.W_WAIT0), rng.randint(5, 999)), ("wait 0 on event",)),
        (lambda d, t, rng: _word(d, _task_word(d, t, tt.W_WEIGHT_WAIT), rng.randint(5, 999)), ("the weight wait on event",)),
        (lambda d, t, rng: _word(d, _word(d, tt.H_LISTS_OFFSET) + 1 + t % 7, rng.randint(10**3, 10**6)), ("list offsets must rise",)),
        (lambda d, t, rng: _word(d, tt.H_TASKS_OFFSET, _word(d, tt.H_TASKS_OFFSET) + 32 * rng.randint(100, 999)), ("the tasks", "outside the device part")),
        (lambda d, t, rng: _word(d, tt.H_NUM_EVENTS, rng.randint(-9, -1)), ("header counts",)),
    ],
)
def test_a_garbage_table_with_a_matching_hash_is_refused(art, corrupt, fragments):
    rng = random.Random(len(fragments[0]))
    tasks = load_artifact(art)[1].num_tasks
    _rewrite_table(art, lambda d: corrupt(d, rng.randrange(tasks), rng))
    refused(art, "task_table.bin: ", *fragments)


def test_a_bad_task_is_named_with_its_list(art):
    """The refusal names the task and the CTA list it sits in (found from the table's list offsets)."""
    data = (art / "task_table.bin").read_bytes()
    offsets = struct.unpack_from(f"<{load_artifact(art)[1].num_lists + 1}i", data, 4 * _word(bytearray(data), tt.H_LISTS_OFFSET))
    cta = next(c for c in range(len(offsets) - 1) if offsets[c + 1] - offsets[c] >= 2 and c > 0)
    task = offsets[cta] + 1  # the second task of a list other than the first
    _rewrite_table(art, lambda d: _word(d, _task_word(d, task, tt.W_OPCODE), 77))
    refused(art, f"task {task} (list {cta}): opcode 77")


def test_signal_counts_must_match_the_tasks(art):
    """A task that signals another (valid) event than the one its count was derived for."""
    def change(d):
        signal = _task_word(d, 0, tt.W_SIGNAL)
        _word(d, signal, (_word(d, signal) + 1) % 5)

    _rewrite_table(art, change)
    refused(art, "signals per step, the tasks make")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_without_a_gpu_the_runtime_says_so_after_validating(art):
    with pytest.raises(NoDeviceError, match=r"art: a valid sm_90a artifact, but no CUDA GPU is available"):
        Megakernel(art)
    edit_manifest(art, lambda m: m.update(num_ctas="8"))
    with pytest.raises(ArtifactError, match="field 'num_ctas'"):  # validation comes first
        Megakernel(art)


def test_tables_agree():
    assert schema.BUFFER_ROLES == tt.BUFFER_ROLES
    assert set(DTYPES) == set(schema.DTYPE_BYTES) and all(DTYPES[n].itemsize == b for n, b in schema.DTYPE_BYTES.items())
    assert set(TARGET_ARCHS) == set(schema.ARCHS)  # --arch offers exactly the archs the build and the runtime know
    for name, (_, _, _, sms) in TARGET_ARCHS.items():
        assert schema.ARCHS[name].sm_count == sms
