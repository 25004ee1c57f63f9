"""The megakernel's step reports non-finite logits per request (k3mk.runtime.tokens) instead of a
normal-looking token (issue 16). On the whole-model artifact k3-tiny batch 4 (tests/runtime/
build_model_artifacts.py -> artifacts_dev/model_k3-tiny_b4), random bf16 weights:

- clean weights: every request gets a token, the kernel's own argmax of its (finite) logits;
- an Inf planted in the embedding row of request 0's token (weights are bound by pointer, so the
  planted value is what the kernel reads): request 0's logits are not finite and its token is
  NONFINITE_TOKEN (-1); requests 1-3 keep finite logits and their tokens (rows are independent);
- a NaN planted in one lm_head row: every request's logits hold it, every token is -1;
- the same report from a CUDA graph of `mk.step()` + `mark_nonfinite` (capturable: no host sync);
- `check_finite=False` returns the kernel's raw argmax (what it writes for a NaN row is recorded).
Results go to $K3MK_RESULTS (JSON) when set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_model_gpu import artifact_or_skip, config_of  # noqa: E402

pytestmark = pytest.mark.gpu
BATCH = 4


def _model():
    from k3mk.compiler.random_weights import random_weights
    from k3mk.runtime.model import DecodeModel

    art = artifact_or_skip("k3-tiny", BATCH)
    config = config_of("k3-tiny")
    weights = random_weights(config, 0, torch.bfloat16, device=torch.device("cuda"))
    return config, weights, DecodeModel(art, weights)


def test_non_finite_logits_are_reported_per_request():
    from k3mk.runtime.tokens import NONFINITE_TOKEN, mark_nonfinite

    config, weights, model = _model()
    gen = torch.Generator().manual_seed(16)
    tokens = torch.randperm(config.vocab_size, generator=gen)[:BATCH].to(torch.int32).cuda()
    positions = torch.zeros(BATCH, dtype=torch.int32, device="cuda")
    record = {}

    next_tokens, logits = model.step(tokens, positions)
    torch.cuda.synchronize()
    assert torch.isfinite(logits).all()
    clean = next_tokens.clone()
    assert (clean >= 0).all() and torch.equal(clean.long(), logits.float().argmax(-1))
    record["clean_tokens"] = clean.tolist()

    # an Inf in the embedding row of request 0's token: only request 0's logits go non-finite
    embed = weights["model.embed_tokens.weight"]
    row = embed[int(tokens[0])].clone()
    embed[int(tokens[0]), int(torch.randint(embed.shape[1], (1,), generator=gen))] = float("inf")
    next_tokens, logits = model.step(tokens, positions + 1)
    torch.cuda.synchronize()
    finite = torch.isfinite(logits).all(-1)
    record["embedding_inf"] = {"tokens": next_tokens.tolist(), "finite_rows": finite.tolist()}
    assert not finite[0] and finite[1:].all(), finite
    assert int(next_tokens[0]) == NONFINITE_TOKEN
    assert torch.equal(next_tokens[1:].long(), logits[1:].float().argmax(-1))
    _, _ = model.step(tokens, positions + 2, check_finite=False)
    raw = model.buffer("next_tokens").clone()
    record["embedding_inf"]["raw_kernel_tokens"] = raw.tolist()  # what the kernel's argmax writes for the NaN row
    assert torch.equal(raw[1:].long(), model.buffer("logits")[1:].float().argmax(-1))
    embed[int(tokens[0])] = row

    # a NaN in one lm_head row: every request's logits hold it
    head = weights["lm_head.weight"]
    vocab_row = int(torch.randint(config.vocab_size, (1,), generator=gen))
    saved = head[vocab_row].clone()
    head[vocab_row, 5] = float("nan")
    next_tokens, logits = model.step(tokens, positions + 3)
    torch.cuda.synchronize()
    record["lm_head_nan"] = {"tokens": next_tokens.tolist()}
    assert torch.isnan(logits[:, vocab_row]).all() and (next_tokens == NONFINITE_TOKEN).all()

    # the same report from a CUDA graph of the launch and the check
    mk = model.mk
    mk.buffer("token_ids").copy_(tokens)
    mk.buffer("positions").fill_(4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mk.step()
        mark_nonfinite(mk.buffer("next_tokens"), mk.buffer("logits"))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mk.step()
        mark_nonfinite(mk.buffer("next_tokens"), mk.buffer("logits"))
    graph.replay()
    torch.cuda.synchronize()
    record["graph_lm_head_nan"] = mk.buffer("next_tokens").tolist()
    assert (mk.buffer("next_tokens") == NONFINITE_TOKEN).all()
    head[vocab_row] = saved
    for state in model.states.values():  # request 0's state holds the embedding's Inf since its step: start over
        state.zero_()
    mk.buffer("positions").fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    record["graph_clean"] = mk.buffer("next_tokens").tolist()
    assert (mk.buffer("next_tokens") >= 0).all() and torch.isfinite(mk.buffer("logits")).all()

    print(json.dumps(record), file=sys.stderr)
    if os.environ.get("K3MK_RESULTS"):
        Path(os.environ["K3MK_RESULTS"]).write_text(json.dumps(record, indent=1))
