"""The step's per-request report (k3mk.runtime.tokens): a row whose logits hold a NaN or an Inf gets
NONFINITE_TOKEN instead of its argmax; every other row keeps its token. The reference generation
raises on it (k3mk.compiler.generate)."""

from __future__ import annotations

import pytest
import torch

from k3mk.compiler.config import load_config
from k3mk.compiler.generate import NonFiniteLogits, build_decode_step, greedy_generate
from k3mk.compiler.random_weights import random_weights
from k3mk.runtime.tokens import NONFINITE_TOKEN, mark_nonfinite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_rows_with_a_non_finite_logit_are_marked(dtype, bad):
    gen = torch.Generator().manual_seed({"nan": 1, "inf": 2, "-inf": 3}[str(bad)] * 10 + dtype.itemsize)
    batch, vocab = 7, 1031
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    rows = torch.randperm(batch, generator=gen)[:3]
    cols = torch.randint(vocab, (3,), generator=gen)
    logits[rows, cols] = bad
    tokens = logits.float().nan_to_num(nan=-1e30).argmax(-1).to(torch.int32)
    want = tokens.clone()
    want[rows] = NONFINITE_TOKEN
    out = mark_nonfinite(tokens, logits)
    assert out is tokens and torch.equal(tokens, want)  # in place
    assert NONFINITE_TOKEN < 0  # never a token id


def test_reference_generation_raises_on_non_finite_logits():
    """A NaN planted in one lm_head row (past the loader's check, in memory) makes every logit row NaN
    at that column: the first generated token is refused."""
    config = load_config("k3-tiny")
    weights = random_weights(config, seed=5)
    step = build_decode_step(config, weights, torch.float32)
    tokens = greedy_generate(step, [11, 250], 2)
    assert len(tokens) == 2 and all(0 <= t < config.vocab_size for t in tokens)
    row = int(torch.randint(config.vocab_size, (1,), generator=torch.Generator().manual_seed(2)))
    step.w("lm_head.weight")[row, 3] = float("nan")
    with pytest.raises(NonFiniteLogits, match=r"decode step 2 \(position 1\) produced non-finite logits \(NaN or Inf\) instead of token 1 of 2; tokens before it: none"):
        greedy_generate(step, [11, 250], 2)
