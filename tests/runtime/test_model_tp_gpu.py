"""k3-tiny at TP 2 with ONE PROCESS PER GPU (docs/megakernel.md "Tensor parallelism"): ONE artifact, each
rank a process with its own megakernel on its own GPU, its shard of the weights and state
(k3mk.runtime.tp.TPRank over a gloo TPGroup, comm regions exchanged as CUDA IPC handles), under the
SAME acceptance as the single-GPU test (tests/runtime/test_model_gpu.py, `run_acceptance`): against the
unsharded bf16 reference decode step on rank 0's GPU, 64 teacher-forced steps, batch 1 and 4, tokens at
clear steps, logits within LOGIT_TOL (sharding adds roundings: each rank's partial sums are bf16 before
the all-reduce), experts as sets. Also: one launch per rank per step, and both ranks' next tokens
bitwise equal at every step (`TPRank.step` raises on every rank otherwise).

Rank 0 runs the acceptance and sends each step's inputs to rank 1, which follows. The GPUs are
K3MK_TP_GPUS (default 0,1); 0,0 puts both ranks on one GPU, where every collective waits for the GPU
to switch processes (a slow test of the whole path on one GPU, if the GPU time-slices the two
cooperative kernels; the step deadline ends it otherwise). The step times of this test include a host
round trip per step (the inputs sent to rank 1): measure TP step times with launches alone.

Artifacts are prebuilt on a CPU machine: `python tests/runtime/build_tp_artifacts.py` ->
artifacts_dev/model_k3-tiny_b<batch>_tp2.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_model_gpu import ARTIFACTS, _router_id_views, config_of, report_and_check, run_acceptance  # noqa: E402

pytestmark = pytest.mark.gpu
TP = 2
CASES = [("k3-tiny", 1), ("k3-tiny", 4)]
DEADLINE_S, SETUP_DEADLINE_S = 60.0, 300.0


def tp_artifact(name: str, batch: int) -> Path:
    return ARTIFACTS / f"model_{name}_b{batch}_tp{TP}"


def gpus() -> list[int]:
    return [int(g) for g in os.environ.get("K3MK_TP_GPUS", "0,1").split(",")]


def rank_main(rank: int, port: int, name: str, batch: int, out: str) -> None:
    """One rank: its weights (rank 0: the full ones too, for the reference), its TPRank; rank 0 runs the
    acceptance and writes its record to `out`, rank 1 follows the inputs rank 0 sends."""
    from k3mk.compiler.random_weights import random_weights
    from k3mk.runtime.manifest import load_manifest
    from k3mk.runtime.tp import TPRank, rank_pieces
    from k3mk.runtime.tp_group import TPGroup, init_group

    config, art = config_of(name), tp_artifact(name, batch)
    device = torch.device("cuda", gpus()[rank])
    torch.cuda.set_device(device)
    group = TPGroup(init_group(rank, TP, "127.0.0.1", port, SETUP_DEADLINE_S), DEADLINE_S, SETUP_DEADLINE_S)
    shards = load_manifest(art)["tp_shards"]
    if rank == 0:
        weights = random_weights(config, 0, torch.bfloat16, device)
        pieces = rank_pieces(weights, shards, rank)
    else:  # the same values: each tensor is drawn from its own seeded CUDA generator
        pieces = random_weights(config, 0, torch.bfloat16, device, shards=shards, rank=rank)
    current = torch.cuda.current_device()
    model = TPRank(art, pieces, group, rank, device)
    assert torch.cuda.current_device() == current, "setting up the rank changed the current device"
    assert (model.batch, model.tp) == (batch, TP)

    def step(tokens, positions):
        group.broadcast_json("inputs", [torch.as_tensor(tokens).tolist(), torch.as_tensor(positions).tolist()])
        return model.step(tokens, positions)

    if rank == 0:
        rec = run_acceptance(config, batch, weights, step, _router_id_views(model.model.mk), launches_per_step=1)
        group.broadcast_json("inputs", None)
        Path(out).write_text(json.dumps(rec))
    else:
        while (inputs := group.broadcast_json("inputs", None)) is not None:
            model.step(*inputs)
    model.close()


@pytest.mark.parametrize("name,batch", CASES)
def test_tp2_one_process_per_gpu_matches_the_single_gpu_reference(name, batch, tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() <= max(gpus()):
        pytest.skip(f"needs GPUs {gpus()} (K3MK_TP_GPUS)")
    art = tp_artifact(name, batch)
    if not (art / "manifest.json").exists():
        pytest.skip(f"{art} not built (tests/runtime/build_tp_artifacts.py)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "record.json"
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), name, str(batch), str(out)], stderr=subprocess.PIPE, text=True)
             for r in range(TP)]  # fmt: skip
    errors = [p.communicate(timeout=1200)[1] for p in procs]
    for rank, (p, err) in enumerate(zip(procs, errors)):
        assert p.returncode == 0, f"rank {rank} (status {p.returncode}):\n{err[-4000:]}"
    rec = json.loads(out.read_text())
    if isinstance(rec["profiler_kernels_3_steps"], list):
        rec["profiler_kernels_3_steps"] = tuple(rec["profiler_kernels_3_steps"])
    report_and_check(f"{name}_b{batch}_tp{TP}_processes", rec, launches_per_step=1)


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5])
