"""A profile build on the GPU (docs/megakernel.md "Profile builds"): k3-tiny batch 1 built with and without
--profile (`python tests/runtime/build_model_artifacts.py model_k3-tiny_b1 model_k3-tiny_b1_profile`), the
same random weights, the same tokens fed to both for STEPS steps (more than the ring of
abi.PROFILE_RING_STEPS, so the ring wraps):
- identical next tokens and bit-identical logits (profiling adds timer reads and stores, nothing else);
- every record is from its step, every task's stamps are in order (start <= wait_done <= body_end, the
  producer's ring waits within its produce interval), each list's tasks follow one another for the
  consumers and for the producer, every waiter's wait_done >= each of its events' signallers' body_end
  stamps, and a CTA's tasks all ran on one SM; the bytes the producers issued equal the streamed tiles';
- the ring keeps exactly the last PROFILE_RING_STEPS steps; the summary accounts for all CTA time.
The last step's summary is printed (-s); with $K3MK_RESULTS set, written there as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_model_gpu import ARTIFACTS, artifact_or_skip, config_of  # noqa: E402

pytestmark = pytest.mark.gpu
STEPS = 6


def test_profile_build_matches_release_and_its_records_are_sound():
    release_dir = artifact_or_skip("k3-tiny", 1)
    profile_dir = ARTIFACTS / "model_k3-tiny_b1_profile"
    if not (profile_dir / "manifest.json").exists():
        pytest.skip(f"{profile_dir} not built (tests/runtime/build_model_artifacts.py)")
    from k3mk.compiler.random_weights import random_weights
    from k3mk.runtime import abi
    from k3mk.runtime.model import DecodeModel
    from k3mk.runtime.profile import Timeline, format_summary, summarize

    assert (release_dir / "task_table.bin").read_bytes() == (profile_dir / "task_table.bin").read_bytes(), (
        "the two artifacts hold different task tables: rebuild both from one tree")
    weights = random_weights(config_of("k3-tiny"), 0, torch.bfloat16, device="cuda")
    release, profile = DecodeModel(release_dir, weights), DecodeModel(profile_dir, weights)
    assert profile.mk.profile_build and not release.mk.profile_build
    with pytest.raises(RuntimeError, match="not a profile build"):
        release.mk.profile_records()
    tokens = torch.tensor([7], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        for t in range(STEPS):
            positions = torch.tensor([t], dtype=torch.int32, device="cuda")
            want_tokens, want_logits = release.step(tokens, positions)
            got_tokens, got_logits = profile.step(tokens, positions)
            torch.cuda.synchronize()
            assert torch.equal(got_tokens, want_tokens), t
            assert torch.equal(got_logits, want_logits), t
            tl = Timeline.of(profile.mk)
            assert tl.step == t + 1
            problems = tl.violations()
            assert not problems, problems[:10]
            for tasks in tl.lists().values():
                assert len({tl.times[i].smid for i in tasks}) == 1
            tokens = want_tokens.clone()
    assert profile.mk.epoch == STEPS
    profile.mk.profile_records(STEPS - abi.PROFILE_RING_STEPS + 1)  # the oldest step the ring keeps
    with pytest.raises(ValueError, match="not among the last"):
        profile.mk.profile_records(STEPS - abi.PROFILE_RING_STEPS)
    s = summarize(tl)
    assert sum(s["cta_time_ns"].values()) == s["ctas"] * s["wall_ns"] > 0
    assert s["tasks"] == profile.mk.table.num_tasks and s["weight_bytes"] > 0 and s["issued_bytes"] > 0
    assert s["handoff"]["blocking"] > 0
    print(format_summary(s))
    out = os.environ.get("K3MK_RESULTS")
    if out:
        Path(out).write_text(json.dumps(s, indent=1))
