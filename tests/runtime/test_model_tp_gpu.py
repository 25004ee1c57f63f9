"""k3-tiny at TP 2 on two GPUs (docs/megakernel.md "Tensor parallelism"): ONE artifact, each rank its own
megakernel on its own GPU with its shard of the weights and state (k3mk.runtime.tp.TPDecodeModel), under
the SAME acceptance as the single-GPU test (tests/runtime/test_model_gpu.py, `run_acceptance`): against
the unsharded bf16 reference decode step on one GPU, 64 teacher-forced steps, batch 1 and 4, tokens at
clear steps, logits within LOGIT_TOL (sharding adds roundings: each rank's partial sums are bf16 before
the all-reduce), experts as sets. Also: one launch per rank per step, and both ranks' next tokens and
expert choices bitwise equal at every step (the all-reduce rounds the same way on every rank).

Artifacts are prebuilt on a CPU machine: `python tests/runtime/build_tp_artifacts.py` ->
artifacts_dev/model_k3-tiny_b<batch>_tp2. Skips without 2 GPUs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_model_gpu import ARTIFACTS, MAX_CONTEXT, STEPS, _router_id_views, config_of, report_and_check, run_acceptance  # noqa: E402

pytestmark = pytest.mark.gpu
TP = 2
CASES = [("k3-tiny", 1), ("k3-tiny", 4)]


def tp_artifact(name: str, batch: int) -> Path:
    return ARTIFACTS / f"model_{name}_b{batch}_tp{TP}"


def tp_artifact_or_skip(name: str, batch: int) -> Path:
    if not torch.cuda.is_available() or torch.cuda.device_count() < TP:
        pytest.skip(f"needs {TP} GPUs")
    art = tp_artifact(name, batch)
    if not (art / "manifest.json").exists():
        pytest.skip(f"{art} not built (tests/runtime/build_tp_artifacts.py)")
    return art


@pytest.mark.parametrize("name,batch", CASES)
def test_tp2_step_matches_the_single_gpu_reference(name, batch):
    art = tp_artifact_or_skip(name, batch)
    from k3mk.compiler.random_weights import random_weights
    from k3mk.runtime.tp import TPDecodeModel

    config = config_of(name)
    weights = random_weights(config, 0, torch.bfloat16, device=torch.device("cuda", 0))  # full weights, cut per rank
    current = torch.cuda.current_device()
    model = TPDecodeModel(art, weights)
    assert torch.cuda.current_device() == current, "loading the TP model changed the caller's current device"
    assert (model.tp, model.batch, model.max_context) == (TP, batch, MAX_CONTEXT)
    views = [_router_id_views(mk) for mk in model.ranks]
    agreement = {"checked_steps": 0, "rank_token_disagreements": 0, "rank_expert_disagreements": 0}

    def step(tokens, positions):
        """The teacher-forced steps: logits assembled, ranks compared; then (timed and profiled) launches only."""
        if agreement["checked_steps"] == STEPS:
            return model.launch(tokens, positions), None
        agreement["checked_steps"] += 1
        next_tokens, logits = model.step(tokens, positions)
        other = model.ranks[1].buffer("next_tokens").to(next_tokens.device)
        agreement["rank_token_disagreements"] += not torch.equal(other, next_tokens)
        for mine, theirs in zip(*views):
            if mine is not None:
                agreement["rank_expert_disagreements"] += not torch.equal(theirs.to(mine.device), mine)
        return next_tokens, logits

    rec = run_acceptance(config, batch, weights, step, views[0], launches_per_step=TP)
    assert torch.cuda.current_device() == current, "a TP step changed the caller's current device"
    rec.update(agreement)
    report_and_check(f"{name}_b{batch}_tp{TP}", rec, launches_per_step=TP)
    assert agreement["checked_steps"] == STEPS
    assert agreement["rank_token_disagreements"] == 0 and agreement["rank_expert_disagreements"] == 0
