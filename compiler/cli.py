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
import importlib.util
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from k3mk import __version__
from k3mk.codegen.artifact_dir import CACHE_ENV, cache_root, check_destination, install, locked, writable_directory
from k3mk.codegen.ops import KERNEL_TUNING
from k3mk.codegen.ops import MAX_BATCH as MAX_TOKENS
from k3mk.compiler import limits
from k3mk.compiler.artifact_cache import SUMMARY_FILE, CompileOptions, discard, entry_path, usable
from k3mk.compiler.config import PRESETS, ConfigError, ModelConfig, load_config
from k3mk.runtime.schema import ARCHS

EXIT_USAGE = 2  # argparse's status for usage errors; every reported error uses it
EXIT_CHECK = 1  # generate --check: the megakernel's tokens differ from the reference's
DEFAULT_DEADLINE_S = 60.0  # generate --artifact: a decode step of the group
DEFAULT_SETUP_DEADLINE_S = 900.0  # ... the ranks waiting for each other after loading their weights


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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, found {text}")
    return value


def _gpus(text: str) -> list[int]:
    """--gpus' value: comma-separated GPU indices."""
    entries = text.split(",")
    if not all(re.fullmatch(r"[0-9]+", e.strip()) for e in entries):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of GPU indices (expected e.g. 0,1)")
    return [int(e) for e in entries]


def _kernel_option(text: str) -> tuple[str, int]:
    """--kernel-option's value: KEY=INTEGER, KEY a KernelConfig tuning knob."""
    key, _, value = text.partition("=")
    if key not in KERNEL_TUNING or not re.fullmatch(r"-?[0-9]+", value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=INTEGER with KEY one of {', '.join(KERNEL_TUNING)}")
    return key, int(value)


def _thread_count(text: str) -> int:
    value = _positive(text)
    if value > (os.cpu_count() or 1):
        raise argparse.ArgumentTypeError(f"must be at most {os.cpu_count()} (this machine's CPUs), found {value}")
    return value


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="greedy generation with the reference decode step or a compiled artifact",
        description=(
            "Feed the prompt one token per decode step, then generate STEPS tokens greedily. Prints the generated token ids "
            "(not the prompt), comma separated, on one line of stdout; progress goes to stderr. The decode state "
            "holds len(prompt) + STEPS tokens of context: at most the model's max_position_embeddings, and for the reference "
            "with the weights within the memory available on --device (both checked before loading). A step whose logits "
            "are not finite (NaN or Inf) is an error, not a token.\n\n"
            "Without --artifact the reference decode step runs (PyTorch, the compiler's numerics oracle). With --artifact "
            "DIR the compiled megakernel of DIR runs on the GPU in bfloat16, one process per GPU for a tensor-parallel "
            "artifact (its tp ranks, started here, or one rank per process under torchrun); with --check the reference "
            "decode step also runs on rank 0's GPU and every step's token is compared with it (the reference's token is fed "
            "to both, so a near tie does not make the later steps incomparable): exit status 1 if a token differs at a "
            "step whose reference top-1 / top-2 gap is clear."
        ),
        epilog=(
            "examples:\n\n"
            "  k3mk random-checkpoint --model k3-tiny --out /tmp/k3-tiny-random\n"
            "  k3mk generate --model k3-tiny --checkpoint /tmp/k3-tiny-random --prompt 1,2,3 --steps 8\n"
            "  k3mk compile --model k3-tiny --tp 2 --max-context 128 --out /tmp/k3-tiny-tp2\n"
            "  k3mk generate --artifact /tmp/k3-tiny-tp2 --checkpoint /tmp/k3-tiny-random --prompt 1,2,3 --steps 8 --check"
        ),
        formatter_class=_Formatter,
    )
    p.add_argument("--model", metavar="MODEL", help=_MODEL_HELP + " (with --artifact: default, the artifact's model)")
    weights = p.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", type=Path, metavar="DIR", help="checkpoint directory (safetensors files) for MODEL")
    weights.add_argument("--random-weights", type=int, metavar="SEED",
                         help="seeded random weights (those `k3mk random-checkpoint --seed SEED` writes), made on the device")  # fmt: skip
    p.add_argument("--prompt", required=True, type=_token_ids, metavar="IDS", help="prompt token ids, comma separated, e.g. 1,2,3")
    p.add_argument("--steps", required=True, type=_positive, metavar="N", help="number of tokens to generate (>= 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="where the reference runs (default: cpu; --artifact: the GPU)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="the reference's dtype; the spec's fp32 parameters and state stay fp32 either way (default: float32; "
        "--artifact: bfloat16, the artifact's)",
    )
    p.add_argument(
        "--threads",
        type=_thread_count,
        default=1,
        metavar="T",
        help=f"CPU threads for torch, at most this machine's {os.cpu_count()} CPUs (default: 1; the decode step is many "
        "small ops, where more threads mostly spin: on a busy 2-core machine one thread ran a k3-tiny step 10x faster than two)",
    )
    art = p.add_argument_group("compiled artifacts")
    art.add_argument("--artifact", type=Path, metavar="DIR", help="run the megakernel of this artifact (k3mk compile --out DIR) instead")
    art.add_argument("--check", action="store_true", help="also run the reference on rank 0's GPU and compare every step")
    art.add_argument("--tp", type=_positive, metavar="N", help="processes, one per rank: the artifact's tp (default: the artifact's)")
    art.add_argument("--gpus", type=_gpus, metavar="LIST",
                     help="GPU of each rank, e.g. 0,1 (default: 0..N-1); ranks sharing a GPU (0,0) only test the IPC path: "
                     "their collectives then wait for the GPU to switch processes")  # fmt: skip
    art.add_argument("--deadline", type=_seconds, default=DEFAULT_DEADLINE_S, metavar="S",
                     help=f"a step that takes longer fails every rank, naming the rank (default: {DEFAULT_DEADLINE_S:g})")  # fmt: skip
    art.add_argument("--setup-deadline", type=_seconds, default=DEFAULT_SETUP_DEADLINE_S, metavar="S",
                     help=f"how long the ranks wait for each other at setup, after loading their weights (default: {DEFAULT_SETUP_DEADLINE_S:g})")  # fmt: skip
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    if args.artifact is not None:
        return _run_generate_artifact(args)
    given = [f"--{name.replace('_', '-')}" for name in ("check", "tp", "gpus") if getattr(args, name)]
    if given:
        raise UsageError(f"{given[0]} applies to a compiled artifact: give --artifact DIR")
    if args.model is None:
        raise UsageError("--model is required without --artifact")
    import torch

    from k3mk.compiler.generate import build_decode_step, greedy_generate

    config = load_config(args.model)
    _check_prompt(config, args.prompt)
    device, dtype_name = args.device or "cpu", args.dtype or "float32"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is available to torch on this machine")
    dtype = getattr(torch, dtype_name)
    _check_generate_memory(config, len(args.prompt) + args.steps, dtype, device)
    torch.set_num_threads(args.threads)
    _progress(f"loading {_weight_source(args)} as {config.name} ({dtype_name}, {device}) ...")
    start = time.monotonic()
    step = build_decode_step(config, _load_weights(args, config, dtype, device), dtype)
    _progress(f"loaded in {time.monotonic() - start:.1f} s; running {len(args.prompt) + args.steps - 1} decode steps ...")
    tokens = greedy_generate(step, args.prompt, args.steps, on_step=_step_progress(_progress))
    print(",".join(map(str, tokens)))
    return 0


def _check_prompt(config: ModelConfig, prompt: list[int]) -> None:
    too_big = [t for t in prompt if t >= config.vocab_size]
    if too_big:
        raise UsageError(f"--prompt: token id {too_big[0]} is out of range (the vocabulary of {config.name} has {config.vocab_size} tokens)")


def _weight_source(args: argparse.Namespace) -> str:
    return str(args.checkpoint) if args.checkpoint is not None else f"random weights (seed {args.random_weights})"


def _load_weights(args: argparse.Namespace, config: ModelConfig, dtype, device, shards=None, rank: int = 0) -> dict:
    """--checkpoint or --random-weights; with `shards` (an artifact's tp_shards) rank `rank`'s pieces."""
    if args.random_weights is not None:
        from k3mk.compiler.random_weights import random_weights

        return random_weights(config, args.random_weights, dtype, device, shards=shards, rank=rank)
    from k3mk.compiler.checkpoint import load_checkpoint

    checkpoint: Path = args.checkpoint
    if not checkpoint.is_dir():
        raise UsageError(f"--checkpoint {checkpoint}: no such directory")
    _check_checkpoint_config(config, checkpoint)
    return load_checkpoint(config, checkpoint, dtype=dtype, device=device, shards=shards, rank=rank)


def _step_progress(say: Callable[[str], None]) -> Callable[[int, int], None]:
    """on_step for the generation loops: a line every few seconds, not per step."""
    start = last_report = time.monotonic()

    def on_step(done: int, total: int) -> None:
        nonlocal last_report
        if time.monotonic() - last_report > 5 or done == total:
            last_report = time.monotonic()
            say(f"decode step {done}/{total} ({time.monotonic() - start:.1f} s)")

    return on_step


def _artifact_config(args: argparse.Namespace, manifest) -> ModelConfig:
    """--model, or the artifact's own model (a preset); either way the config the artifact was compiled
    from (its config hash)."""
    name = args.model or manifest.data.get("model")
    if name is None:
        raise UsageError(f"--artifact {args.artifact}: its manifest names no model: give --model")
    try:
        config = load_config(name)
    except ConfigError as e:
        raise UsageError(f"--artifact {args.artifact} was compiled for model '{name}', which is not a preset ({e}): give --model") from None
    want = manifest.data.get("config_hash")
    if want is not None and config.hash() != want:
        raise UsageError(f"--artifact {args.artifact} was compiled for config hash {want} (model '{manifest.data.get('model')}'), "
                         f"but --model {name} has hash {config.hash()}")  # fmt: skip
    return config


def _run_generate_artifact(args: argparse.Namespace) -> int:
    """Check what can be checked here, then run this process's rank (under a launcher, or at tp 1) or
    start one process per rank (k3mk.compiler.tp_launch)."""
    import torch

    from k3mk.compiler import tp_launch
    from k3mk.runtime.manifest import load_manifest

    manifest = load_manifest(args.artifact)
    config = _artifact_config(args, manifest)
    _check_prompt(config, args.prompt)
    tp, context = manifest.data.get("tp", 1), manifest.data.get("max_context", 0)
    if args.tp is not None and args.tp != tp:
        raise UsageError(f"--tp {args.tp}: the artifact {args.artifact} is compiled for tp {tp}")
    if len(args.prompt) + args.steps > context:
        raise UsageError(f"--prompt and --steps need a context of {len(args.prompt) + args.steps} tokens; the artifact holds {context}")
    if args.device == "cpu" or args.dtype == "float32":
        raise UsageError("--artifact runs the megakernel on the GPU in bfloat16: --device cpu / --dtype float32 do not apply")
    if args.checkpoint is not None:
        if not args.checkpoint.is_dir():
            raise UsageError(f"--checkpoint {args.checkpoint}: no such directory")
        _check_checkpoint_config(config, args.checkpoint)
    gpus = args.gpus or list(range(tp))
    if len(gpus) != tp:
        raise UsageError(f"--gpus {','.join(map(str, gpus))}: {tp} ranks need {tp} GPUs")
    if not torch.cuda.is_available():
        raise UsageError("--artifact: the megakernel runs on a CUDA GPU, and torch sees none on this machine")
    if max(gpus) >= torch.cuda.device_count():
        raise UsageError(f"--gpus: GPU {max(gpus)} does not exist ({torch.cuda.device_count()} visible)")
    try:
        launched = tp_launch.rank_from_env()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if launched is None and tp > 1:
        if len(set(gpus)) < tp:
            _progress(f"ranks share GPUs ({','.join(map(str, gpus))}): a test only, every collective waits for the GPU to switch processes")
        return tp_launch.run_ranks(args.argv, tp, grace_s=args.setup_deadline + 2 * args.deadline, say=_progress)
    rank, size, address, port = launched or (0, 1, "", 0)
    if size != tp:
        raise UsageError(f"launched as rank {rank} of {size} processes, but the artifact {args.artifact} is compiled for tp {tp}")
    return _generate_on_rank(args, config, manifest, rank, size, address, port, torch.device("cuda", gpus[rank]))


def _generate_on_rank(args: argparse.Namespace, config: ModelConfig, manifest, rank: int, size: int, address: str, port: int, device) -> int:
    """One rank of `k3mk generate --artifact`: its group, its weights, its TPRank; rank 0 prints. A stalled
    kernel (TPGroupError.gpu_stuck) may still spin on the GPU: the process ends at once, without the
    teardown that would synchronise with it (the driver reclaims the GPU at exit)."""
    import os

    import torch

    from k3mk.compiler.generate import build_decode_step, megakernel_generate
    from k3mk.runtime.tp import TPRank, rank_pieces
    from k3mk.runtime.tp_group import TPGroup, TPGroupError, init_group

    say = _progress if rank == 0 else (lambda line: None)
    torch.cuda.set_device(device)
    try:
        group = TPGroup(init_group(rank, size, address, port, args.setup_deadline) if size > 1 else None, args.deadline, args.setup_deadline)
        say(f"loading {_weight_source(args)} as {config.name}, {size} rank{'s' if size > 1 else ''} (one process each) ...")
        start = time.monotonic()
        shards, reference = manifest.data.get("tp_shards", {}), None
        with group.local("loading this rank's weights"):
            if args.check and rank == 0:  # the reference needs the full weights; the kernel binds its pieces of them
                full = _load_weights(args, config, torch.bfloat16, device)
                reference, weights = build_decode_step(config, full, torch.bfloat16), rank_pieces(full, shards, rank)
            else:
                weights = _load_weights(args, config, torch.bfloat16, device, shards, rank)
        model = TPRank(args.artifact, weights, group, rank, device)
        say(f"loaded in {time.monotonic() - start:.1f} s; running {len(args.prompt) + args.steps - 1} decode steps ...")
        tokens, check = megakernel_generate(model, args.prompt, args.steps, reference, _step_progress(say))
        model.close()
    except TPGroupError as e:
        print(f"k3mk: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        if e.gpu_stuck:
            os._exit(EXIT_USAGE)
        return EXIT_USAGE
    if rank != 0:
        return 0
    print(",".join(map(str, tokens)), flush=True)
    return _report_check(check) if check is not None else 0


def _report_check(check) -> int:
    """The --check summary on stderr; EXIT_CHECK if a token differs at a clear step."""
    near = "; ".join(f"step {s}: {k} vs {r} (gap {g:.3g})" for s, k, r, g in check.differ_near_tie)
    _progress(f"check against the reference decode step (bfloat16, GPU): {check.steps} steps, {check.near_ties} near ties"
              f"{' (tokens differ at ' + near + ')' if near else ''}; logits ||d||/||ref|| at most {check.max_logit_rel:.3g}")  # fmt: skip
    if not check.differ_clear:
        _progress(f"tokens equal to the reference's at every step with a clear top-1 / top-2 gap ({check.steps - check.near_ties})")
        return 0
    listing = "; ".join(f"step {s}: {k} instead of {r} (reference top-1 / top-2 gap {g:.3g})" for s, k, r, g in check.differ_clear)
    print(f"k3mk: error: the megakernel's token differs from the reference's at {len(check.differ_clear)} clear step(s): {listing}", file=sys.stderr)
    return EXIT_CHECK


def _check_generate_memory(config: ModelConfig, context: int, dtype, device: str) -> None:
    """len(prompt) + steps within the model's context, and its decode state plus the weights within the
    memory available on `device`: a clear error up front instead of an allocator's after loading."""
    import torch

    if config.max_context is not None and context > config.max_context:
        raise UsageError(f"--steps: len(--prompt) + --steps = {context} tokens exceed the {config.max_context} of context {config.name} supports (max_position_embeddings)")
    compute = dtype.itemsize
    need = limits.state_size(config, 1, 1, context, compute).total + limits.weight_bytes(config, compute)
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else _available_host_memory()
    if need > free:
        raise UsageError(f"--steps: {context} tokens of context need {limits.format_bytes(need)} (weights and decode state in "
                         f"{str(dtype).removeprefix('torch.')}), more than the {limits.format_bytes(free)} available on {device}")  # fmt: skip


def _available_host_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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

_CACHE_HELP = (
    "Artifacts are cached whole: a compile of a target built before (the same config, options, target, k3mk sources "
    f"and CuTe DSL) copies the cached artifact to --out in well under a second. The cache directory is ${CACHE_ENV}, "
    "or ~/.cache/k3mk when it is unset (kernels/: compiled cubins; artifacts/: whole artifacts); delete it to reclaim "
    "the space."
)


def _add_compile(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compile",
        help="compile a model's decode step for a tensor-parallel degree",
        description=(
            "Capture MODEL's decode step and run the compile pipeline (tensor-parallel sharding, fusion, "
            "tiling, memory plan, events and their static check, per-SM schedule, task table). Prints a summary: "
            "the decode state per rank, tasks and bytes per SM, the predicted step time (sm_90a: a replay of the streaming loop with H200 constants) and the roofline "
            "at the target's NOMINAL bandwidth. With --dump, writes the IR after every pass and the schedule; with --out, "
            "writes the compiled artifact (written whole or not at all; an existing artifact there is replaced as a whole, "
            "a directory holding anything else is refused).\n\n"
            f"Limits, checked before the pipeline runs: --max-tokens 1 to {MAX_TOKENS}; --max-context up to the model's "
            "max_position_embeddings, with the decode state it needs per rank within the largest GPU of --arch; the "
            "model's widths within what the op templates generate.\n\n" + _CACHE_HELP
        ),
        epilog="examples:\n\n  k3mk compile --model kimi-k3 --tp 8 --arch sm_100a --out k3-tp8-sm100a\n  k3mk compile --model k3-tiny --max-tokens 4 --dump /tmp/k3-tiny-ir",
        formatter_class=_Formatter,
    )
    p.add_argument("--model", required=True, metavar="MODEL", help=_MODEL_HELP)
    p.add_argument("--tp", type=_positive, default=1, metavar="N", help="tensor-parallel degree: one artifact for all N ranks (default: 1)")
    p.add_argument("--max-tokens", type=_positive, default=1, metavar="B",
                   help=f"tokens per decode step: requests x (1 + draft tokens), at most {MAX_TOKENS} (default: 1)")  # fmt: skip
    p.add_argument("--max-context", type=_positive, default=4096, metavar="T", help="latent cache length per request (default: 4096)")
    p.add_argument("--arch", choices=tuple(ARCHS), default="sm_90a",
                   help="target GPU architecture: " + ", ".join(f"{a.name} ({a.devices})" for a in ARCHS.values()) + " (default: sm_90a)")  # fmt: skip
    p.add_argument("--dump", type=Path, metavar="DIR", help="write the IR after capture and after every pass to DIR/NN_<pass>.txt")
    p.add_argument("--show-rank", type=int, metavar="R", help="also print which slice of every split tensor rank R loads")
    p.add_argument("--out", type=Path, metavar="DIR", help="build the megakernel artifact (cubin, task table, manifest) into DIR")
    p.add_argument("--until", metavar="PASS", help="stop after this pass of the pipeline (default: every pass written so far)")
    p.add_argument("--profile", action="store_true",
                   help="with --out: a profile build, whose kernel records per-task timestamps (k3mk.runtime.profile; bench/timeline.py)")  # fmt: skip
    p.add_argument("--kernel-option", type=_kernel_option, action="append", default=[], metavar="KEY=VALUE",
                   help="with --out: a kernel tuning knob for sweeps (k3mk.codegen.ops.KernelConfig: "
                        f"{', '.join(KERNEL_TUNING)}; integers); repeatable")  # fmt: skip
    p.set_defaults(run=_run_compile)


# The compile extra (pyproject [compile]): module -> distribution. The passes need networkx and numpy;
# the artifact build needs jinja2 (the templates) and CuTe DSL (the kernel compile).
_PIPELINE_MODULES = {"networkx": "networkx", "numpy": "numpy"}
_BUILD_MODULES = {"jinja2": "jinja2", "cutlass": "nvidia-cutlass-dsl"}


def _require_modules(modules: dict[str, str], what: str) -> None:
    missing = [dist for module, dist in modules.items() if not _importable(module)]
    if missing:
        raise UsageError(f"{what} needs {', '.join(missing)} (the compile extra): pip install 'k3mk[compile]'")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_compile(args: argparse.Namespace) -> None:
    """What `k3mk compile` can check before anything runs: option combinations, writable --dump, --out
    and cache, the compile extra for the passes (the target's limits: compiler/limits.py, before capture)."""
    limits.check_tokens(args.max_tokens)  # at once: a step of thousands of tokens would run the passes for minutes
    if args.show_rank is not None and not 0 <= args.show_rank < args.tp:
        raise UsageError(f"--show-rank {args.show_rank}: ranks are 0..{args.tp - 1} at --tp {args.tp}")
    for flag, on in (("--profile", args.profile), ("--kernel-option", bool(args.kernel_option))):
        if on and args.out is None:
            raise UsageError(f"{flag} applies to the artifact build: give --out")
    if args.out is not None and args.until is not None:
        raise UsageError(f"--until {args.until}: an artifact (--out) needs every pass; give one of the two")
    if args.dump is not None:
        writable_directory(args.dump, "--dump")
    if args.out is not None:
        check_destination(args.out, "--out")
        writable_directory(cache_root() / "artifacts", f"the compile cache (${CACHE_ENV}, default ~/.cache/k3mk):")
    _require_modules(_PIPELINE_MODULES, "k3mk compile")


def _run_compile(args: argparse.Namespace) -> int:
    config = load_config(args.model)
    _check_compile(args)
    if args.out is None:
        from k3mk.compiler.pipeline import run_compile

        return run_compile(args, config)
    options = CompileOptions(args.tp, args.max_tokens, args.max_context, args.arch, args.profile, tuple(sorted(args.kernel_option)))
    entry = entry_path(config, options)
    with locked(args.out, wait=False), locked(entry):  # one writer per --out; a target is built once
        if args.dump is None and usable(entry):
            _progress(f"cached: {entry} (same config, options, target, k3mk sources and CuTe DSL); copying it to {args.out}")
            print((entry / SUMMARY_FILE).read_text(), end="")
        else:
            _require_modules(_BUILD_MODULES, "k3mk compile --out")
            from k3mk.compiler.pipeline import run_compile

            discard(entry)
            run_compile(args, config, entry)
        install(entry, args.out)
    print(f"artifact: {args.out}")
    return 0


# --- inspect -----------------------------------------------------------------------------------------


def _add_inspect(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="summarise a compiled artifact directory",
        description=(
            "Read an artifact directory written by 'k3mk compile --out', validate "
            "its manifest completely (every field, format and ABI versions, every file's hash) and print what it "
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

    m = load_manifest(args.artifact)  # the complete schema (k3mk/runtime/schema.py) and this runtime's ABI
    m.check_files()
    print(f"artifact {m.path}")
    for key in sorted(m.data):
        if key not in ("files", "files_sha256"):
            print(f"  {key}: {_describe(m.data[key])}")
    print("files:")
    for role in sorted(m.data["files"]):
        path = m.file(role)
        print(f"  {role}: {path.name} ({path.stat().st_size:,} bytes, hash ok)")
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
        epilog=(
            "run 'k3mk COMMAND --help' for a command's options and an example\n\n"
            f"environment: {CACHE_ENV} is the compile cache directory (compiled kernels and whole artifacts; "
            "default ~/.cache/k3mk)"
        ),
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"k3mk {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True, parser_class=_Parser)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


class Terminated(BaseException):
    """SIGTERM (what timeout, systemd and CI send): unwinds like Ctrl-C, so that the CuTe compile worker
    is killed (subprocess.run kills its child on any exception) and temporary directories are removed."""


def _terminate(signum, frame) -> NoReturn:
    raise Terminated()


# Errors that mean "the input is wrong", reported as one line; anything else is a bug and keeps its
# traceback. Each counts once its module is loaded (most are imported lazily, with torch, so that
# `--help` and a warm compile stay fast).
_REPORTED = (("k3mk.compiler.checkpoint", "CheckpointError"), ("k3mk.compiler.limits", "CompileError"),
             ("k3mk.compiler.generate", "NonFiniteLogits"), ("k3mk.runtime.schema", "ArtifactError"),
             ("k3mk.codegen.artifact_dir", "ArtifactDirError"), ("k3mk.passes.emit_task_table", "EmitError"),
             ("k3mk.codegen.ops", "CodegenError"), ("k3mk.codegen.build", "BuildError"))  # fmt: skip


def _is_reported(error: Exception) -> bool:
    kinds: tuple[type, ...] = (UsageError, ConfigError, OSError)
    for module, name in _REPORTED:
        loaded = sys.modules.get(module)
        kinds += (getattr(loaded, name),) if loaded else ()
    return isinstance(error, kinds)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `k3mk` console script. Returns the exit status: 0, or 2 after an error line
    (130 after Ctrl-C, 143 after SIGTERM)."""
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # what a launcher passes on to the processes it starts
        return args.run(args)
    except SystemExit as e:  # --help and --version exit through argparse
        return int(e.code or 0)
    except KeyboardInterrupt:
        print("k3mk: interrupted", file=sys.stderr)
        return 130  # the shell's status for SIGINT
    except Terminated:
        print("k3mk: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except Exception as e:
        if not _is_reported(e):
            raise
        print(f"k3mk: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
