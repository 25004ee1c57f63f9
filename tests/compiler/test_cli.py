"""The `k3mk` command line: help for every subcommand, one-line errors with exit status 2 (never a
traceback), random-checkpoint + generate on k3-tiny end to end, and what `generate --artifact` checks
and starts without a GPU (tests/runtime/generate_artifact_gpu.sh runs it on one)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
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
    assert "predicted step time" in out and "NOMINAL" in out
    assert (tmp_path / "00_capture.txt").is_file() and any(tmp_path.glob("*_schedule.txt"))
    assert main(["compile", "--model", "k3-tiny", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3mk: error:") and "3" in err and "\n" == err[-1] and err.count("\n") == 1


def test_inspect_artifact(capsys, tmp_path, monkeypatch):
    """`k3mk inspect` summarises a built artifact and checks its file hashes; a tampered file is a
    one-line error."""
    pytest.importorskip("cutlass", reason="building an artifact needs nvidia-cutlass-dsl (the compile extra)")
    from k3mk.codegen.build import build

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from megakernel_cases import all_cases

    monkeypatch.setenv("K3MK_CACHE_DIR", str(tmp_path / "cache"))
    out = build(all_cases()["gemv_b1"].builder.table(), tmp_path / "artifact", arch="sm_90a")
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "arch: sm_90a" in text and "cubin" in text and "hash ok" in text
    cubin = next(out.glob("*.cubin"))
    blob = bytearray(cubin.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    cubin.write_bytes(bytes(blob))
    assert main(["inspect", str(out)]) == 2
    assert "does not match the hash" in capsys.readouterr().err


# --- generate --artifact ----------------------------------------------------------------------------


def fake_artifact(directory: Path, **fields) -> Path:
    """A manifest with what `generate --artifact` reads before it needs a GPU (k3-tiny at TP2)."""
    from k3mk.compiler.config import load_config
    from k3mk.runtime import abi
    from k3mk.runtime.table import FORMAT_VERSION

    data = {"manifest_version": 1, "abi_version": abi.ABI_VERSION, "task_table_format": FORMAT_VERSION, "params": abi.params_json(),
            "control_words": abi.CONTROL_WORDS, "debug_words_per_cta": abi.DEBUG_WORDS, "model": "k3-tiny",
            "config_hash": load_config("k3-tiny").hash(), "tp": 2, "max_context": 16, **fields}  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "manifest.json").write_text(json.dumps(data))
    return directory


def test_generate_artifact_errors(capsys, tmp_path, checkpoint):
    art = str(fake_artifact(tmp_path / "art"))
    args = ["generate", "--artifact", art, "--random-weights", "0", "--prompt", "1,2", "--steps"]
    assert_error(capsys, *args, "2", "--tp", "4", says=f"--tp 4: the artifact {art} is compiled for tp 2")
    assert_error(capsys, *args, "15", says="need a context of 17 tokens; the artifact holds 16")
    assert_error(capsys, *args, "2", "--model", "kimi-linear-tiny", says="was compiled for config hash")
    assert_error(capsys, *args, "2", "--device", "cpu", says="--device cpu / --dtype float32 do not apply")
    assert_error(capsys, *args, "2", "--gpus", "0", says="--gpus 0: 2 ranks need 2 GPUs")
    assert_error(capsys, *args, "2", "--deadline", "0", says="argument --deadline: must be more than 0 seconds")
    assert_error(capsys, *args[:3], "--checkpoint", str(tmp_path / "absent"), *args[5:], "2", says="no such directory")
    assert_error(capsys, *args[:3], "--random-weights", "0", "--prompt", "1,4096", "--steps", "1", says="token id 4096 is out of range")
    fake_artifact(tmp_path / "other", model="my-model")
    assert_error(capsys, *args[:2], str(tmp_path / "other"), *args[3:], "2", says="compiled for model 'my-model', which is not a preset")
    reference = ["generate", "--model", "k3-tiny", "--checkpoint", str(checkpoint), "--prompt", "1", "--steps", "1"]
    assert_error(capsys, *reference, "--check", says="--check applies to a compiled artifact: give --artifact DIR")
    assert_error(capsys, *reference, "--tp", "2", says="--tp applies to a compiled artifact")
    assert_error(capsys, "generate", "--random-weights", "1", "--prompt", "1", "--steps", "1", says="--model is required without --artifact")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_generate_artifact_without_gpu(capsys, tmp_path):
    args = ["generate", "--artifact", str(fake_artifact(tmp_path / "art")), "--random-weights", "0", "--prompt", "1", "--steps", "1"]
    assert_error(capsys, *args, says="--artifact: the megakernel runs on a CUDA GPU, and torch sees none")


def test_generate_with_random_weights_equals_their_checkpoint(capsys, checkpoint):
    argv = ["generate", "--model", "k3-tiny", "--prompt", "17,4095", "--steps", str(STEPS)]
    status, from_checkpoint, err = run(capsys, *argv, "--checkpoint", str(checkpoint))
    assert status == 0, err
    status, from_seed, err = run(capsys, *argv, "--random-weights", "3")  # the fixture's seed
    assert status == 0 and from_seed == from_checkpoint, err


def test_ranks_are_started_and_their_status_gathered(tmp_path, capfd):
    from k3mk.compiler import tp_launch

    art = fake_artifact(tmp_path / "art")
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
