"""The `k3mk` command line: help for every subcommand, one-line errors with exit status 2 (never a
traceback), random-checkpoint + generate on k3-tiny end to end, and what `generate --artifact` checks
and starts without a GPU (tests/runtime/generate_artifact_gpu.sh runs it on one)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from importlib import resources

import pytest
import torch

from k3mk.compiler.cli import main

STEPS = 3  # a few decode steps prove the loop; the transformers parity test checks the tokens


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def assert_error(capsys, *argv: str, says: str) -> None:
    status, out, err = run(capsys, *argv)
    assert status == 2, (status, err)
    assert out == ""
    # progress lines may come first; the error is one line, the last, and there is no traceback
    lines = err.strip().splitlines()
    assert lines[-1].startswith("k3mk: error: ") and says in lines[-1], err
    assert sum(line.startswith("k3mk: error") for line in lines) == 1 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random k3-tiny checkpoint written through the CLI."""
    directory = tmp_path_factory.mktemp("cli") / "k3-tiny"
    assert main(["random-checkpoint", "--model", "k3-tiny", "--out", str(directory), "--seed", "3"]) == 0
    return directory


# --- help --------------------------------------------------------------------------------------------


def test_help(capsys):
    status, out, _ = run(capsys, "--help")
    assert status == 0
    assert "random-checkpoint" in out and "generate" in out


@pytest.mark.parametrize("command", ["random-checkpoint", "generate"])
def test_subcommand_help(capsys, command):
    status, out, _ = run(capsys, command, "--help")
    assert status == 0
    assert "--model" in out and re.search(r"examples?:", out) and f"k3mk {command} --model k3-tiny" in out


def test_version(capsys):
    status, out, _ = run(capsys, "--version")
    assert status == 0 and out.startswith("k3mk ")


# --- errors ------------------------------------------------------------------------------------------


def test_usage_errors(capsys, tmp_path):
    assert_error(capsys, says="required: COMMAND")
    assert_error(capsys, "compile-everything", says="invalid choice")
    assert_error(capsys, "generate", "--model", "k3-tiny", says="required")
    args = ["generate", "--model", "k3-tiny", "--checkpoint", str(tmp_path)]
    assert_error(capsys, *args, "--prompt", "1,,x", "--steps", "2", says="argument --prompt: '1,,x'")
    assert_error(capsys, *args, "--prompt", "1,-2", "--steps", "2", says="argument --prompt")
    assert_error(capsys, *args, "--prompt", "1,2", "--steps", "0", says="argument --steps: must be at least 1, found 0")
    assert_error(capsys, *args, "--prompt", "1,2", "--steps", "two", says="argument --steps: 'two'")
    assert_error(capsys, *args, "--prompt", "1,4096", "--steps", "2", says="token id 4096 is out of range")
    assert_error(capsys, *args, "--prompt", "1", "--steps", "2", "--dtype", "float16", says="argument --dtype")
    assert_error(capsys, *args, "--prompt", "1", "--steps", "2", "--threads", "0", says="argument --threads")


def test_model_errors(capsys, tmp_path):
    assert_error(capsys, "random-checkpoint", "--model", "k3-huge", "--out", str(tmp_path / "x"), says="'k3-huge' is neither a preset")
    config = json.loads(resources.files("k3mk.compiler").joinpath("presets", "k3-tiny.json").read_text())
    config["text_config"]["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_error(capsys, "random-checkpoint", "--model", str(tmp_path), "--out", str(tmp_path / "x"), says="field 'text_config.hidden_act'")


def test_checkpoint_errors(capsys, tmp_path, checkpoint):
    args = ["--prompt", "1,2", "--steps", "2"]
    assert_error(capsys, "generate", "--model", "k3-tiny", "--checkpoint", str(tmp_path / "absent"), *args, says="no such directory")
    assert_error(capsys, "generate", "--model", "k3-tiny", "--checkpoint", str(tmp_path), *args, says="no model.safetensors")
    assert_error(capsys, "generate", "--model", "kimi-k3-0.40b", "--checkpoint", str(checkpoint), *args, says="different model")
    assert_error(capsys, "random-checkpoint", "--model", "k3-tiny", "--out", str(checkpoint), says="not an empty directory")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_gpu(capsys, checkpoint):
    argv = ["generate", "--model", "k3-tiny", "--checkpoint", str(checkpoint), "--prompt", "1", "--steps", "1", "--device", "cuda"]
    assert_error(capsys, *argv, says="--device cuda: no CUDA GPU")


def test_error_in_a_real_process():
    """As a separate process (what the console script runs): exit status 2, one stderr line, no traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "k3mk.compiler.cli", "generate", "--model", "k3-tiny", "--checkpoint", ".", "--prompt", "x", "--steps", "1"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stdout == "" and result.stderr.startswith("k3mk: error: argument --prompt") and "Traceback" not in result.stderr


# --- end to end --------------------------------------------------------------------------------------


def test_random_checkpoint_and_generate(capsys, checkpoint):
    assert (checkpoint / "config.json").is_file() and (checkpoint / "model.safetensors").is_file()
    argv = ["generate", "--model", "k3-tiny", "--checkpoint", str(checkpoint), "--prompt", "17,4095", "--steps", str(STEPS)]
    status, out, err = run(capsys, *argv)
    assert status == 0, err
    tokens = [int(t) for t in out.strip().split(",")]
    assert len(tokens) == STEPS and all(0 <= t < 4096 for t in tokens)
    assert out.count("\n") == 1 and "loading" in err  # the result alone on stdout, progress on stderr
    # deterministic, and the checkpoint's own config.json works as --model too
    status, again, err = run(capsys, "generate", "--model", str(checkpoint), *argv[3:])
    assert status == 0 and again == out, err


def test_generate_bfloat16(capsys, checkpoint):
    argv = ["generate", "--model", "k3-tiny", "--checkpoint", str(checkpoint), "--prompt", "17", "--steps", "1", "--dtype", "bfloat16"]
    status, out, err = run(capsys, *argv)
    assert status == 0, err
    assert 0 <= int(out) < 4096


def test_compile_summary_and_errors(capsys, tmp_path):
    """`k3mk compile` runs the pass pipeline on k3-tiny at TP2 and prints the summary; a degree that
    does not divide the heads is a one-line error."""
    assert main(["compile", "--model", "k3-tiny", "--tp", "2", "--max-tokens", "2", "--max-context", "64", "--until", "check_deadlock", "--dump", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "placement cost model's step time (schedule)" in out and "NOMINAL" in out
    assert (tmp_path / "00_capture.txt").is_file() and any(tmp_path.glob("*_schedule.txt"))
    # with the table emitted, an sm_90a compile predicts the step by replaying the streaming loop (ir/replay.py)
    assert main(["compile", "--model", "k3-tiny", "--max-context", "64", "--until", "emit_task_table"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("predicted step time (streaming replay"))
    assert float(line.split(": ")[1].split(" us")[0]) > 0 and "producers blocked on a full ring" in line
    assert main(["compile", "--model", "k3-tiny", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3mk: error:") and "3" in err and "\n" == err[-1] and err.count("\n") == 1


def test_inspect_artifact(capsys, tmp_path):
    """`k3mk inspect` validates the whole manifest and every file's hash (the ptx too); a tampered file or
    a malformed manifest is a one-line error."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from fake_artifact import edit_manifest, fake_artifact, model_meta

    out = fake_artifact(tmp_path / "artifact", meta=model_meta())
    status, text, _ = run(capsys, "inspect", str(out))
    assert status == 0 and "arch: sm_90a" in text and "max_tokens: 1" in text
    for role in ("cubin", "ptx", "source", "task_table"):
        assert re.search(rf"  {role}: \S+ \([\d,]+ bytes, hash ok\)", text), text
    ptx = next(out.glob("*.ptx"))
    ptx.write_text(ptx.read_text() + "// edited\n")
    assert_error(capsys, "inspect", str(out), says=f"{ptx} does not match the hash in its manifest")
    edit_manifest(out, lambda m: m.pop("files_sha256"))
    assert_error(capsys, "inspect", str(out), says="manifest.json: field 'files_sha256' is missing")
    (out / "manifest.json").write_text('{"arch": "sm_90a", ')
    assert_error(capsys, "inspect", str(out), says="manifest.json: not a readable JSON manifest")
    assert_error(capsys, "inspect", str(tmp_path), says="has no manifest.json: not a k3mk artifact")


# --- limits and bad inputs found before any work ---------------------------------------------------


def test_help_states_the_cache_and_the_limits(capsys):
    status, out, _ = run(capsys, "--help")
    assert status == 0 and "K3MK_CACHE_DIR" in out and "~/.cache/k3mk" in out
    status, out, _ = run(capsys, "compile", "--help")
    flat = " ".join(out.split())
    assert status == 0 and "$K3MK_CACHE_DIR" in flat and "--max-tokens 1 to 16" in flat
    assert "sm_103a (B300 / GB300)" in flat and "{sm_90a,sm_100a,sm_103a}" in flat


def test_generate_limits(capsys, tmp_path, checkpoint):
    args = ["generate", "--model", "k3-tiny", "--checkpoint", str(checkpoint), "--prompt", "5,9"]
    assert_error(capsys, *args, "--steps", "2", "--threads", str(100000), says=f"argument --threads: must be at most {os.cpu_count()}")
    start = time.monotonic()
    assert_error(capsys, *args, "--steps", "4095", says="len(--prompt) + --steps = 4097 tokens exceed the 4096 of context k3-tiny supports")
    # kimi-k3's weights alone are terabytes: refused before loading (an empty checkpoint directory is never read)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_error(capsys, "generate", "--model", "kimi-k3", "--checkpoint", str(empty), "--prompt", "1", "--steps", "1",
                 says="--steps: 2 tokens of context need")  # fmt: skip
    assert time.monotonic() - start < 10, "the limits must be checked before the checkpoint is loaded"


def test_generate_reports_non_finite_logits(capsys, tmp_path, checkpoint):
    """Finite but huge lm_head rows overflow their logits to Inf: the step reports it instead of a token."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "huge-head"
    shutil.copytree(checkpoint, broken)
    tensors = load_file(broken / "model.safetensors")
    rows = torch.randperm(4096, generator=torch.Generator().manual_seed(4))[:3]
    head = tensors["language_model.lm_head.weight"].clone()
    head[rows] = 3.0e38  # finite in bf16 (max 3.39e38); the weights check passes
    tensors["language_model.lm_head.weight"] = head
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    argv = ["generate", "--model", "k3-tiny", "--checkpoint", str(broken), "--prompt", "17,4", "--steps", "3"]
    assert_error(capsys, *argv, says="decode step 2 (position 1) produced non-finite logits (NaN or Inf) instead of token 1 of 3")


def test_compile_option_errors_come_first(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("K3MK_CACHE_DIR", str(tmp_path / "cache"))
    start = time.monotonic()
    assert_error(capsys, "compile", "--model", "k3-tiny", "--tp", "2", "--show-rank", "2", says="--show-rank 2: ranks are 0..1 at --tp 2")
    assert_error(capsys, "compile", "--model", "k3-tiny", "--tp", "0", says="argument --tp: must be at least 1")
    assert_error(capsys, "compile", "--model", "k3-tiny", "--max-tokens", "2048", says="--max-tokens 2048: the megakernel runs 1 to 16 tokens per step")
    assert_error(capsys, "compile", "--model", "k3-tiny", "--profile", says="--profile applies to the artifact build: give --out")
    assert_error(capsys, "compile", "--model", "k3-tiny", "--out", str(tmp_path / "o"), "--until", "fuse", says="--until fuse: an artifact (--out) needs every pass")
    assert_error(capsys, "compile", "--model", "k3-tiny", "--arch", "sm_89", says="argument --arch: invalid choice: 'sm_89'")
    a_file = tmp_path / "a-file"
    a_file.write_text(str(random.random()))
    assert_error(capsys, "compile", "--model", "k3-tiny", "--dump", str(a_file / "ir"), says=f"--dump {a_file / 'ir'} is not a writable directory")
    # --out: a directory holding other files is refused before the pipeline, and left as it was
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    assert_error(capsys, "compile", "--model", "k3-tiny", "--out", str(user), says=f"--out {user}: is not a k3mk artifact (e.g. 'notes.txt'); refusing")
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]
    assert_error(capsys, "compile", "--model", "k3-tiny", "--out", str(a_file), says=f"--out {a_file}: exists and is not a directory")
    monkeypatch.setenv("K3MK_CACHE_DIR", str(a_file))
    assert_error(capsys, "compile", "--model", "k3-tiny", "--out", str(tmp_path / "new"), says="the compile cache ($K3MK_CACHE_DIR, default ~/.cache/k3mk):")
    assert time.monotonic() - start < 5, "option errors must come before the capture"


def test_compile_without_the_compile_extra(capsys, tmp_path, monkeypatch):
    """Without CuTe DSL, `--out` is refused before the passes run (not a traceback after them)."""

    class NoCutlass:
        def find_spec(self, name, path=None, target=None):
            if name == "cutlass" or name.startswith("cutlass."):
                raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setenv("K3MK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "meta_path", [NoCutlass(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "cutlass", raising=False)
    start = time.monotonic()
    assert_error(capsys, "compile", "--model", "k3-tiny", "--out", str(tmp_path / "art"),
                 says="k3mk compile --out needs nvidia-cutlass-dsl (the compile extra): pip install 'k3mk[compile]'")  # fmt: skip
    assert time.monotonic() - start < 5 and not (tmp_path / "art").exists()


def test_the_token_limit_is_refused_before_torch_loads():
    script = ("import sys; from k3mk.compiler.cli import main; status = main(sys.argv[1:]); "
              "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(status)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", script, "compile", "--model", "k3-tiny", "--max-tokens", "2048"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == "k3mk: error: --max-tokens 2048: the megakernel runs 1 to 16 tokens per step (requests x (1 + draft tokens))\n", proc.stderr


# --- generate --artifact ----------------------------------------------------------------------------


def tp2_artifact(directory: Path, **fields) -> Path:
    """A schema-valid artifact of k3-tiny at TP2 (a stand-in kernel: what `generate --artifact` reads
    before it needs a GPU)."""
    from k3mk.compiler.config import load_config

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from fake_artifact import edit_manifest, fake_artifact, model_meta

    art = fake_artifact(directory, meta=model_meta(max_context=16))
    changes = {"model": "k3-tiny", "config_hash": load_config("k3-tiny").hash(), "tp": 2, "tp_shards": {},
               "comm": {"ranks": 2, "events": 1, "half": 16, "nbytes": 288}, **fields}  # fmt: skip
    edit_manifest(art, lambda m: m.update(changes))
    return art


def test_generate_artifact_errors(capsys, tmp_path, checkpoint):
    art = str(tp2_artifact(tmp_path / "art"))
    args = ["generate", "--artifact", art, "--random-weights", "0", "--prompt", "1,2", "--steps"]
    assert_error(capsys, *args, "2", "--tp", "4", says=f"--tp 4: the artifact {art} is compiled for tp 2")
    assert_error(capsys, *args, "15", says="need a context of 17 tokens; the artifact holds 16")
    assert_error(capsys, *args, "2", "--model", "kimi-linear-tiny", says="was compiled for config hash")
    assert_error(capsys, *args, "2", "--device", "cpu", says="--device cpu / --dtype float32 do not apply")
    assert_error(capsys, *args, "2", "--gpus", "0", says="--gpus 0: 2 ranks need 2 GPUs")
    assert_error(capsys, *args, "2", "--deadline", "0", says="argument --deadline: must be more than 0 seconds")
    assert_error(capsys, *args[:3], "--checkpoint", str(tmp_path / "absent"), *args[5:], "2", says="no such directory")
    assert_error(capsys, *args[:3], "--random-weights", "0", "--prompt", "1,4096", "--steps", "1", says="token id 4096 is out of range")
    tp2_artifact(tmp_path / "other", model="my-model")
    assert_error(capsys, *args[:2], str(tmp_path / "other"), *args[3:], "2", says="compiled for model 'my-model', which is not a preset")
    reference = ["generate", "--model", "k3-tiny", "--checkpoint", str(checkpoint), "--prompt", "1", "--steps", "1"]
    assert_error(capsys, *reference, "--check", says="--check applies to a compiled artifact: give --artifact DIR")
    assert_error(capsys, *reference, "--tp", "2", says="--tp applies to a compiled artifact")
    assert_error(capsys, "generate", "--random-weights", "1", "--prompt", "1", "--steps", "1", says="--model is required without --artifact")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_generate_artifact_without_gpu(capsys, tmp_path):
    args = ["generate", "--artifact", str(tp2_artifact(tmp_path / "art")), "--random-weights", "0", "--prompt", "1", "--steps", "1"]
    assert_error(capsys, *args, says="--artifact: the megakernel runs on a CUDA GPU, and torch sees none")


def test_generate_with_random_weights_equals_their_checkpoint(capsys, checkpoint):
    argv = ["generate", "--model", "k3-tiny", "--prompt", "17,4095", "--steps", str(STEPS)]
    status, from_checkpoint, err = run(capsys, *argv, "--checkpoint", str(checkpoint))
    assert status == 0, err
    status, from_seed, err = run(capsys, *argv, "--random-weights", "3")  # the fixture's seed
    assert status == 0 and from_seed == from_checkpoint, err


def test_ranks_are_started_and_their_status_gathered(tmp_path, capfd):
    from k3mk.compiler import tp_launch

    art = tp2_artifact(tmp_path / "art")
    lines: list[str] = []
    assert tp_launch.run_ranks(["inspect", str(art)], 2, grace_s=30, say=lines.append) == 0
    assert capfd.readouterr().out.count(f"artifact {art}") == 2 and lines[0].startswith("started 2 processes")
    assert tp_launch.run_ranks(["inspect", str(tmp_path / "absent")], 2, grace_s=30, say=lines.append) == 2
    assert capfd.readouterr().err.count("has no manifest.json") == 2


def test_rank_from_env(monkeypatch):
    from k3mk.compiler import tp_launch

    for name in tp_launch.RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert tp_launch.rank_from_env() is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="RANK, MASTER_ADDR, MASTER_PORT not"):
        tp_launch.rank_from_env()
    for name, value in (("RANK", "3"), ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    assert tp_launch.rank_from_env() == (3, 4, "10.0.0.1", 29500)
