"""The `k3mk` command line.

One function pair per subcommand: `_add_<name>(subparsers)` declares its options and help,
`_run_<name>(args) -> int` does the work. New subcommands (compile, inspect, ...) add one pair and
one line in SUBCOMMANDS.

Every expected failure (a bad option value, an invalid config, an unreadable checkpoint, a missing
GPU) is reported as ONE line on stderr, `k3mk: error: ...`, with exit status 2, never a traceback.
Results go to stdout; progress goes to stderr, so stdout stays machine-readable.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from k3mk import __version__
from k3mk.compiler.config import PRESETS, ConfigError, ModelConfig, load_config

EXIT_USAGE = 2  # argparse's status for usage errors; every reported error uses it


class UsageError(Exception):
    """An error in what the user asked for; reported as `k3mk: error: <message>`."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors reported like every other error (one line, no usage dump)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


class _Formatter(argparse.HelpFormatter):
    """Wraps prose paragraphs to the terminal, keeps indented lines (the examples) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = text.split("\n\n")
        return "\n\n".join(
            p if p.startswith("  ") or "\n  " in p else super(_Formatter, self)._fill_text(p, width, indent) for p in paragraphs
        )


def _progress(message: str) -> None:
    print(f"k3mk: {message}", file=sys.stderr, flush=True)


_MODEL_HELP = f"a preset ({', '.join(PRESETS)}) or a directory holding a config.json"


# --- random-checkpoint -------------------------------------------------------------------------------


def _add_random_checkpoint(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "random-checkpoint",
        help="write a checkpoint of random weights for a model config",
        description=(
            "Write a checkpoint of seeded random weights for MODEL to a new directory: its config.json and "
            "safetensors files in the published checkpoint layout (MXFP4 routed experts where the config "
            "quantizes them). The weights keep activations O(1) and the MoE routing away from near-ties, so "
            "greedy generation from them is a meaningful test. Prints the directory on stdout."
        ),
        epilog="example:\n\n  k3mk random-checkpoint --model k3-tiny --out /tmp/k3-tiny-random --seed 0",
        formatter_class=_Formatter,
    )
    p.add_argument("--model", required=True, metavar="MODEL", help=_MODEL_HELP)
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory to create (it must not exist or be empty)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed; the same seed writes the same weights (default: 0)")
    p.set_defaults(run=_run_random_checkpoint)


def _run_random_checkpoint(args: argparse.Namespace) -> int:
    from k3mk.compiler.random_weights import write_random_checkpoint
    from k3mk.compiler.weights import weight_specs

    config = load_config(args.model)
    out: Path = args.out
    params = sum(spec.numel for spec in weight_specs(config))
    _progress(f"writing a random checkpoint of {config.name} ({params / 1e6:.1f} M weight elements, seed {args.seed}) to {out} ...")
    start = time.monotonic()
    path = write_random_checkpoint(config, out, args.seed)
    _progress(f"done in {time.monotonic() - start:.1f} s")
    print(path)
    return 0


# --- generate ----------------------------------------------------------------------------------------


def _token_ids(text: str) -> list[int]:
    """--prompt's value: comma-separated non-negative integers."""
    entries = text.split(",")
    for i, entry in enumerate(entries):
        if not re.fullmatch(r"[0-9]+", entry.strip()):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of token ids (entry {i + 1} is {entry!r}; expected e.g. 1,2,3)"
            )
    return [int(e) for e in entries]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, found {value}")
    return value


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="greedy generation with the reference decode step",
        description=(
            "Load a checkpoint into the reference decode step (PyTorch, the compiler's numerics oracle), feed the "
            "prompt one token per decode step, then generate STEPS tokens greedily. Prints the generated token ids "
            "(not the prompt), comma separated, on one line of stdout; progress goes to stderr. The decode state "
            "holds len(prompt) + STEPS tokens of context."
        ),
        epilog=(
            "example:\n\n"
            "  k3mk random-checkpoint --model k3-tiny --out /tmp/k3-tiny-random\n"
            "  k3mk generate --model k3-tiny --checkpoint /tmp/k3-tiny-random --prompt 1,2,3 --steps 8"
        ),
        formatter_class=_Formatter,
    )
    p.add_argument("--model", required=True, metavar="MODEL", help=_MODEL_HELP)
    p.add_argument("--checkpoint", required=True, type=Path, metavar="DIR", help="checkpoint directory (safetensors files) for MODEL")
    p.add_argument("--prompt", required=True, type=_token_ids, metavar="IDS", help="prompt token ids, comma separated, e.g. 1,2,3")
    p.add_argument("--steps", required=True, type=_positive, metavar="N", help="number of tokens to generate (>= 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default: cpu)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="model dtype; the spec's fp32 parameters and state stay fp32 either way (default: float32)",
    )
    p.add_argument(
        "--threads",
        type=_positive,
        default=1,
        metavar="T",
        help="CPU threads for torch (default: 1; the decode step is many small ops, where more threads mostly "
        "spin: on a busy 2-core machine one thread ran a k3-tiny step 10x faster than two)",
    )
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    import torch

    from k3mk.compiler.checkpoint import load_checkpoint
    from k3mk.compiler.generate import build_decode_step, greedy_generate

    config = load_config(args.model)
    too_big = [t for t in args.prompt if t >= config.vocab_size]
    if too_big:
        raise UsageError(f"--prompt: token id {too_big[0]} is out of range (the vocabulary of {config.name} has {config.vocab_size} tokens)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is available to torch on this machine")
    checkpoint: Path = args.checkpoint
    if not checkpoint.is_dir():
        raise UsageError(f"--checkpoint {checkpoint}: no such directory")
    _check_checkpoint_config(config, checkpoint)

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    _progress(f"loading {checkpoint} as {config.name} ({args.dtype}, {args.device}) ...")
    start = time.monotonic()
    step = build_decode_step(config, load_checkpoint(config, checkpoint, dtype=dtype, device=args.device), dtype)
    _progress(f"loaded in {time.monotonic() - start:.1f} s; running {len(args.prompt) + args.steps - 1} decode steps ...")

    start, last_report = time.monotonic(), time.monotonic()

    def on_step(done: int, total: int) -> None:
        nonlocal last_report
        if time.monotonic() - last_report > 5 or done == total:  # a line every few seconds, not per step
            last_report = time.monotonic()
            _progress(f"decode step {done}/{total} ({time.monotonic() - start:.1f} s)")

    tokens = greedy_generate(step, args.prompt, args.steps, on_step=on_step)
    print(",".join(map(str, tokens)))
    return 0


def _check_checkpoint_config(config: ModelConfig, checkpoint: Path) -> None:
    """A checkpoint that carries its own config.json must describe the same model as --model: tensor
    shapes could match while, say, the KDA gate form differs, and that would pass silently."""
    if not (checkpoint / "config.json").is_file():
        return
    own = load_config(checkpoint)
    if own.hash() != config.hash():
        raise UsageError(
            f"--checkpoint {checkpoint}: its config.json describes a different model than --model {config.name} "
            f"(pass --model {checkpoint} to use the checkpoint's own config)"
        )


# --- compile -----------------------------------------------------------------------------------------


def _add_compile(subparsers: argparse._SubParsersAction) -> None:
    from k3mk.compiler.pipeline import add_compile_arguments

    p = subparsers.add_parser(
        "compile",
        help="compile a model's decode step for a tensor-parallel degree",
        description=(
            "Capture MODEL's decode step and run the compile pipeline (tensor-parallel sharding, fusion, "
            "tiling, memory plan, events and their static check, per-SM schedule, task table). Prints a summary: "
            "tasks and bytes per SM, the cost model's predicted step time and the roofline at the target's "
            "NOMINAL bandwidth. With --dump, writes the IR after every pass and the schedule; with --arch and "
            "--out, writes the compiled artifact."
        ),
        epilog="examples:\n\n  k3mk compile --model kimi-k3 --tp 8 --arch sm_100a --out k3-tp8-sm100a\n  k3mk compile --model k3-tiny --max-tokens 4 --dump /tmp/k3-tiny-ir",
        formatter_class=_Formatter,
    )
    add_compile_arguments(p)
    p.set_defaults(run=_run_compile)


def _run_compile(args: argparse.Namespace) -> int:
    from k3mk.compiler.pipeline import run_compile

    return run_compile(args)


# --- inspect -----------------------------------------------------------------------------------------


def _add_inspect(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="summarise a compiled artifact directory",
        description=(
            "Read an artifact directory written by 'k3mk compile --out', check "
            "its manifest against this k3mk's runtime (format and ABI versions, file hashes) and print what it "
            "was compiled for and what it holds: target, model, kernel resources, task table and files."
        ),
        epilog="example:\n\n  k3mk inspect /tmp/k3-tiny-artifact",
        formatter_class=_Formatter,
    )
    p.add_argument("artifact", type=Path, metavar="DIR", help="the artifact directory (it holds manifest.json)")
    p.set_defaults(run=_run_inspect)


def _describe(value: object) -> str:
    if isinstance(value, dict):
        return f"{len(value)} entries" if len(value) > 6 else json.dumps(value, sort_keys=True)
    if isinstance(value, list):
        return f"{len(value)} items" if len(value) > 6 else json.dumps(value)
    return str(value)


def _run_inspect(args: argparse.Namespace) -> int:
    from k3mk.runtime.manifest import load_manifest

    m = load_manifest(args.artifact)
    print(f"artifact {m.path}")
    for key in sorted(m.data):
        if key not in ("files", "files_sha256"):
            print(f"  {key}: {_describe(m.data[key])}")
    print("files:")
    for role in sorted(m.data.get("files", {})):
        path = m.file(role)
        m.read_file(role)  # raises if the file does not match its recorded hash
        checked = "hash ok" if role in m.data.get("files_sha256", {}) else "no hash recorded"
        print(f"  {role}: {path.name} ({path.stat().st_size:,} bytes, {checked})")
    return 0


# --- the command -------------------------------------------------------------------------------------

SUBCOMMANDS: Sequence[Callable[[argparse._SubParsersAction], None]] = (_add_random_checkpoint, _add_generate, _add_compile, _add_inspect)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="k3mk",
        description=(
            "k3mk: an ahead-of-time compiler of the Kimi K3 / Kimi Linear decode step into one persistent GPU "
            "megakernel: it parses model configs, reads and writes checkpoints, runs the reference decode step "
            "(the compiler's numerics oracle) and compiles the step into a task table and a CuTe DSL kernel."
        ),
        epilog="run 'k3mk COMMAND --help' for a command's options and an example",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"k3mk {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True, parser_class=_Parser)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def _is_reported(error: Exception) -> bool:
    """Errors that mean "the input is wrong", reported as one line; anything else is a bug and keeps its
    traceback. CheckpointError counts only once the checkpoint module is loaded (it is imported lazily,
    with torch, so that `--help` and config errors stay fast)."""
    checkpoint = sys.modules.get("k3mk.compiler.checkpoint")
    pipeline = sys.modules.get("k3mk.compiler.pipeline")
    kinds = (UsageError, ConfigError, OSError) + ((checkpoint.CheckpointError,) if checkpoint else ())
    kinds += (pipeline.CompileError,) if pipeline else ()
    # Unsupported targets found by later stages (an op the task table or a template cannot express yet).
    for module, name in (("k3mk.runtime.manifest", "ArtifactError"), ("k3mk.passes.emit_task_table", "EmitError"),
                         ("k3mk.codegen.ops", "CodegenError"), ("k3mk.codegen.build", "BuildError")):  # fmt: skip
        loaded = sys.modules.get(module)
        kinds += (getattr(loaded, name),) if loaded else ()
    return isinstance(error, kinds)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `k3mk` console script. Returns the exit status: 0, or 2 after an error line."""
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except SystemExit as e:  # --help and --version exit through argparse
        return int(e.code or 0)
    except KeyboardInterrupt:
        print("k3mk: interrupted", file=sys.stderr)
        return 130  # the shell's status for SIGINT
    except Exception as e:
        if not _is_reported(e):
            raise
        print(f"k3mk: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
