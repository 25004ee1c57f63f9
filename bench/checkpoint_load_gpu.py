"""Peak GPU memory of loading a real-format checkpoint for the megakernel (issue #6: "binds checkpoint
tensors without keeping a second copy").

    python bench/checkpoint_load_gpu.py OUT_JSON [--layers N] [--dir /dev/shm/k3mk_ckpt]

For kimi-linear-48b-a3b (bf16 experts) and k3-proxy-16l (MXFP4 experts) at full width, cut to the first
N layers (default 4: dense, KDA and MLA layers, MoE layers; a full-depth checkpoint does not fit the GPU
machine's disk): random weights are generated on the GPU, written as a published-form checkpoint
(`save_checkpoint`: per-expert tensors, compressed-tensors MXFP4, sharded with an index), freed, then read
back with `load_checkpoint(..., device="cuda")`, the loader the runtime's weights come from. Recorded:
the bytes of the canonical weights, the peak GPU memory the load allocated (torch's allocator) and its
excess over the weights, the load time, and that every tensor round-trips bit-exactly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch


def truncated(name: str, layers: int):
    """The preset's config cut to its first `layers` layers, with a matching config.json."""
    from k3mk.compiler.checkpoint import source_config_json
    from k3mk.compiler.config import load_config

    full = load_config(name)
    config = full.replace(num_layers=layers, layer_kinds=full.layer_kinds[:layers], name=f"{name}-first{layers}")
    raw = json.loads(json.dumps(source_config_json(full)))
    text = raw.get("text_config", raw)
    text["num_hidden_layers"] = layers
    lin = text.get("linear_attn_config") or {}
    for key in ("kda_layers", "full_attn_layers"):
        if key in lin:
            lin[key] = [i for i in lin[key] if i <= layers]  # 1-based layer numbers
    return config, raw


def measure(name: str, layers: int, where: Path) -> dict:
    from k3mk.compiler.checkpoint import load_checkpoint, save_checkpoint
    from k3mk.compiler.random_weights import random_weights

    config, raw = truncated(name, layers)
    dev = torch.device("cuda")
    rec: dict = {"model": name, "layers": layers, "layer_kinds": list(config.layer_kinds)}
    weights = random_weights(config, 0, torch.bfloat16, device=dev)
    rec["weights_gb"] = sum(w.numel() * w.element_size() for w in weights.values()) / 1e9
    rec["largest_tensor_gb"] = max(w.numel() * w.element_size() for w in weights.values()) / 1e9
    shutil.rmtree(where, ignore_errors=True)
    t0 = time.perf_counter()
    save_checkpoint(config, weights, where, config_json=raw)
    rec["save_s"] = time.perf_counter() - t0
    rec["checkpoint_files"] = sorted(p.name for p in where.iterdir())
    rec["checkpoint_gb"] = sum(p.stat().st_size for p in where.iterdir()) / 1e9
    del weights
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    loaded = load_checkpoint(config, where, torch.bfloat16, device=dev)
    torch.cuda.synchronize()
    rec["load_s"] = time.perf_counter() - t0
    rec["load_peak_gb"] = (torch.cuda.max_memory_allocated() - base) / 1e9
    rec["loaded_gb"] = (torch.cuda.memory_allocated() - base) / 1e9
    rec["peak_over_weights_gb"] = rec["load_peak_gb"] - rec["weights_gb"]
    again = random_weights(config, 0, torch.bfloat16, device=dev)
    rec["tensors"] = len(again)
    rec["round_trip_mismatches"] = [n for n in again if not torch.equal(again[n], loaded[n])]
    del loaded, again
    torch.cuda.empty_cache()
    shutil.rmtree(where, ignore_errors=True)
    print(json.dumps({k: v for k, v in rec.items() if k != "checkpoint_files"}), flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm/k3mk_ckpt"))
    args = ap.parse_args()
    recs = [measure(name, args.layers, args.dir) for name in ("kimi-linear-48b-a3b", "k3-proxy-16l")]
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": recs}, indent=1))


if __name__ == "__main__":
    main()
