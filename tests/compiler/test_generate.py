"""megakernel_generate's loop on the CPU (compiler/generate.py), with a stand-in for a TPRank that runs
the reference decode step itself: the prompt fed one token per step into every request slot, the
kernel's own tokens returned, and with a reference every step compared and the reference's token fed
back (so a difference does not make the later steps incomparable)."""

from __future__ import annotations

import pytest
import torch

from k3mk.compiler.config import load_config
from k3mk.compiler.generate import build_decode_step, greedy_generate, megakernel_generate
from k3mk.compiler.random_weights import random_weights
from k3mk.runtime.tp_group import TPGroup


class ReferenceRank:
    """What megakernel_generate needs of a TPRank, computed by a DecodeStep over `batch` request slots;
    `flip`: steps (1-based) whose row-0 token it changes, as a kernel that picks another token would."""

    def __init__(self, step, batch: int, max_context: int, flip=()):
        self.group = TPGroup(None, 1.0, 1.0)
        self.batch, self.max_context, self.flip = batch, max_context, set(flip)
        self.decode, self.state = step, step.new_state(batch, max_context)
        self.inputs: list[list[int]] = []

    def step(self, token_ids, positions):
        self.inputs.append(list(token_ids))
        logits, self.state = self.decode(torch.tensor(token_ids), torch.tensor(positions), self.state)
        tokens = logits.argmax(-1).to(torch.int32)
        if len(self.inputs) in self.flip:
            tokens[0] = (tokens[0] + 1) % logits.shape[-1]
        return tokens, logits


@pytest.fixture(scope="module")
def step():
    config = load_config("k3-tiny")
    return build_decode_step(config, random_weights(config, 5), torch.float32)


def test_tokens_and_an_agreeing_check(step):
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 4096, (3,), generator=gen).tolist()
    with torch.no_grad():
        want = greedy_generate(step, prompt, 6)
    rank = ReferenceRank(step, 2, 12)
    tokens, check = megakernel_generate(rank, prompt, 6)
    assert tokens == want and check is None
    assert [row for row in rank.inputs] == [[t, t] for t in prompt + want[:-1]]  # every request slot, the prompt, then the greedy tokens
    tokens, check = megakernel_generate(ReferenceRank(step, 1, 12), prompt, 6, reference=step)
    assert tokens == want and check.steps == 8 and not check.differ_clear and not check.differ_near_tie and check.max_logit_rel == 0


def test_a_differing_token_is_recorded_and_the_reference_fed_on(step):
    prompt = torch.randint(0, 4096, (2,), generator=torch.Generator().manual_seed(12)).tolist()
    with torch.no_grad():
        want = greedy_generate(step, prompt, 5)
    rank = ReferenceRank(step, 1, 12, flip={4})
    tokens, check = megakernel_generate(rank, prompt, 5, reference=step)
    differ = check.differ_clear + check.differ_near_tie
    assert [(s, k, r) for s, k, r, _ in differ] == [(3, (want[2] + 1) % 4096, want[2])]  # step index 3 = the 4th step
    assert tokens[2] == (want[2] + 1) % 4096 and tokens[:2] == want[:2] and tokens[3:] == want[3:]
    assert [row[0] for row in rank.inputs] == prompt + want[:-1]  # the reference's token went on, not the flipped one


def test_the_context_must_hold_prompt_and_steps(step):
    with pytest.raises(ValueError, match="need a context of 13; the artifact holds 12"):
        megakernel_generate(ReferenceRank(step, 1, 12), [1, 2, 3], 10)
