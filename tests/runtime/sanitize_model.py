"""A short k3-tiny whole-model run for compute-sanitizer (docs/megakernel.md "Sanitizers").

    compute-sanitizer --tool memcheck  python tests/runtime/sanitize_model.py --steps 3
    compute-sanitizer --tool racecheck --kernel-name kns=k3mk_megakernel python tests/runtime/sanitize_model.py --steps 1
    compute-sanitizer --tool synccheck --kernel-name kns=k3mk_megakernel python tests/runtime/sanitize_model.py --steps 1

Loads artifacts_dev/model_<name> (default k3-tiny_b1; `--artifact model_k3-tiny_b1_debug` for the
watchdog build), binds random bf16 weights, runs --steps greedy decode steps (the kernel's own tokens fed
back, positions 3*b + t) and prints the tokens, a logits checksum and the epoch. --watchdog-us is passed
to debug builds (default 600 s: instrumented runs are slow and must not trip the watchdog). Exit 0 on a
clean run; a watchdog firing raises WatchdogError.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_model_gpu import ARTIFACTS, config_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", default="model_k3-tiny_b1")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--watchdog-us", type=int, default=600_000_000)
    args = ap.parse_args()
    torch.cuda.init()  # reach cuInit early: compute-sanitizer attaches there

    from k3mk.compiler.random_weights import random_weights
    from k3mk.runtime.model import DecodeModel

    art = ARTIFACTS / args.artifact
    name = args.artifact.removeprefix("model_").split("_b")[0]
    config = config_of(name)
    dev = torch.device("cuda")
    # weights made on the CPU and copied: the only kernels in the process are the megakernel (and two tiny
    # torch reductions on the logits after each step), so each tool's summary is about the megakernel
    weights = {k: v.to(dev) for k, v in random_weights(config, 0, torch.bfloat16, device="cpu").items()}
    model = DecodeModel(art, weights)
    batch = model.batch
    debug = bool(model.mk.manifest.data.get("debug"))
    gen = torch.Generator().manual_seed(batch)
    tokens = torch.randint(0, config.vocab_size, (batch,), generator=gen).to(torch.int32).to(dev)
    pos0 = (torch.arange(batch, device=dev) * 3).to(torch.int32)
    torch.cuda.synchronize()
    for t in range(args.steps):
        t0 = time.perf_counter()
        model._write("token_ids", tokens)
        model._write("positions", pos0 + t)
        model.mk.step(watchdog_us=args.watchdog_us)
        torch.cuda.synchronize()
        if debug:
            model.mk.check()
        nxt, logits = model.buffer("next_tokens"), model.buffer("logits")
        print(f"step {t}: {time.perf_counter() - t0:.2f} s tokens {nxt.tolist()} logits sum {float(logits.float().sum()):.6g} "
              f"finite {bool(torch.isfinite(logits.float()).all())}", flush=True)  # fmt: skip
        tokens = nxt.clone()
    print(f"{args.artifact}: {args.steps} steps, epoch {model.mk.epoch}, debug {debug}", flush=True)


if __name__ == "__main__":
    main()
