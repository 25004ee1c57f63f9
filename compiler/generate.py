"""Greedy generation, one decode step per token: the prompt is fed one token per step (exactly the step
the megakernel runs), then each step's argmax is fed back. `greedy_generate` runs the reference decode
step (the numerics oracle); `megakernel_generate` a compiled artifact on the GPU, on every rank of its
tensor-parallel group, optionally checked against the reference step by step (`Check`).

Near ties (DESIGN.md "Numerics"): a step whose reference top-1 / top-2 logit gap is below NEAR_TIE, or
within NEAR_TIE_ULPS bf16 ULPs at the top logit, may pick either token in another bf16 computation; a
different token there is reported, not an error (`clear_mask`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from k3mk.compiler.config import ModelConfig
from k3mk.compiler.ops import k3mk
from k3mk.compiler.reference import DecodeStep
from k3mk.runtime.tokens import NONFINITE_TOKEN, mark_nonfinite


class NonFiniteLogits(ValueError):
    """A decode step produced NaN or Inf logits: no token can be chosen."""

NEAR_TIE = 0.05  # top-1 minus top-2 logit: below it a bf16 rounding may pick either token
NEAR_TIE_ULPS = 2  # ... and so within 2 bf16 ULPs at the top logit (clear_mask)


def top2_gap(logits: Tensor) -> Tensor:
    top = logits.float().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def clear_mask(ref_logits: Tensor) -> Tensor:
    """Per request: is the reference's top-1 / top-2 gap clear? Above NEAR_TIE AND above NEAR_TIE_ULPS bf16
    ULPs at the top logit: two bf16 computations may each round the two candidates one ULP apart, and on
    the H200 both observed full-size flips at 'clear' gaps were exactly that (docs/megakernel.md)."""
    top = ref_logits.float().topk(2, dim=-1).values
    ulp = torch.exp2(torch.floor(torch.log2(top[:, 0].abs())) - 7)
    gap = top[:, 0] - top[:, 1]
    return (gap >= NEAR_TIE) & (gap > NEAR_TIE_ULPS * ulp)


def build_decode_step(config: ModelConfig, weights: dict[str, Tensor], dtype: torch.dtype) -> DecodeStep:
    """A DecodeStep that holds `weights` themselves (on their device), without a second copy: the
    module is built on the meta device and the loaded tensors are assigned as its buffers."""
    step = DecodeStep(config, dtype=dtype, device="meta")
    step.load_state_dict(weights, strict=True, assign=True)
    return step


@torch.no_grad()
def greedy_generate(
    step: DecodeStep,
    prompt: Sequence[int],
    steps: int,
    on_step: Callable[[int, int], None] | None = None,
) -> list[int]:
    """Feed `prompt` one token per decode step, then generate `steps` tokens greedily (lowest index
    wins a tie, as in the kernel's argmax). Returns the new tokens only; a step whose logits are not
    all finite raises NonFiniteLogits (k3mk.runtime.tokens, as the megakernel's step reports them).
    `on_step(done, total)` is called after every decode step, for progress reports.

    The state is sized for len(prompt) + steps tokens of context."""
    if not prompt or steps < 1:
        raise ValueError("greedy_generate needs a non-empty prompt and steps >= 1")
    device = step.w("lm_head.weight").device
    state = step.new_state(1, len(prompt) + steps, device=device)
    total = len(prompt) + steps - 1  # the last generated token is never fed back

    def feed(token: int, position: int) -> Tensor:
        nonlocal state
        logits, state = step(torch.tensor([token], device=device), torch.tensor([position], device=device), state)
        if on_step is not None:
            on_step(position + 1, total)
        return logits

    for position, token in enumerate(prompt):
        logits = feed(token, position)
    generated: list[int] = []
    for i in range(steps):
        token = int(mark_nonfinite(k3mk.argmax(logits), logits)[0])
        if token == NONFINITE_TOKEN:
            raise NonFiniteLogits(
                f"decode step {len(prompt) + i} (position {len(prompt) + i - 1}) produced non-finite logits (NaN or Inf) instead "
                f"of token {i + 1} of {steps}; tokens before it: {','.join(map(str, generated)) or 'none'} (the weights are "
                "finite: the loader checks them, so the activations overflowed)"
            )
        generated.append(token)
        if i + 1 < steps:
            logits = feed(token, len(prompt) + i)
    return generated


@dataclass
class Check:
    """The megakernel against the reference, step by step (`megakernel_generate`): each difference as
    (step, the kernel's token, the reference's, the reference's top-1 / top-2 gap)."""

    steps: int = 0
    near_ties: int = 0
    differ_clear: list[tuple[int, int, int, float]] = field(default_factory=list)
    differ_near_tie: list[tuple[int, int, int, float]] = field(default_factory=list)
    max_logit_rel: float = 0.0  # ||kernel - reference|| / ||reference|| over a step's logits

    def record(self, step: int, token: int, logits: Tensor, ref_logits: Tensor) -> int:
        """Compare one step (row 0 of the kernel's logits with the reference's [1, vocab]); the
        reference's token."""
        want = int(k3mk.argmax(ref_logits)[0])
        clear, gap = bool(clear_mask(ref_logits)[0]), float(top2_gap(ref_logits)[0])
        self.steps += 1
        self.near_ties += not clear
        if token != want:
            (self.differ_clear if clear else self.differ_near_tie).append((step, token, want, gap))
        ref = ref_logits[0].float().cpu()
        self.max_logit_rel = max(self.max_logit_rel, float((logits[0].float() - ref).norm() / ref.norm()))
        return want


@torch.no_grad()
def megakernel_generate(
    rank,
    prompt: Sequence[int],
    steps: int,
    reference: DecodeStep | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> tuple[list[int], Check | None]:
    """Greedy generation with a compiled artifact: `rank` is a k3mk.runtime.tp.TPRank (a group of one at
    tp 1), and every rank of the group calls this alike. The prompt goes into every request slot of the
    artifact's batch; row 0's tokens are returned (`steps` of them, as `greedy_generate`).

    With `reference` (rank 0 only: the reference DecodeStep on the full weights, on its GPU) every step's
    token is compared with the reference's (`Check`), and the REFERENCE's token is fed to both, so a
    near-tie flip does not make the later steps incomparable; the tokens returned are still the
    kernel's own argmax at each step. Rank 0 chooses every step's input for the group."""
    total = len(prompt) + steps - 1
    if not prompt or steps < 1 or total + 1 > rank.max_context:
        raise ValueError(f"{len(prompt)} prompt tokens + {steps} steps need a context of {len(prompt) + steps}; the artifact holds {rank.max_context}")
    check = Check() if reference is not None else None
    state = reference.new_state(1, rank.max_context) if reference is not None else None
    device = reference.w("lm_head.weight").device if reference is not None else None
    token, generated = prompt[0], []
    for position in range(total):
        token = rank.group.broadcast_json(f"step {position + 1} input", token)
        tokens, logits = rank.step([token] * rank.batch, [position] * rank.batch)
        mine = int(tokens[0])
        if position >= len(prompt) - 1:
            generated.append(mine)
        if reference is not None:
            ref_logits, state = reference(torch.tensor([token], device=device), torch.tensor([position], device=device), state)
            mine = check.record(position, mine, logits, ref_logits)  # the reference's token goes on
        token = prompt[position + 1] if position + 1 < len(prompt) else mine
        if on_step is not None:
            on_step(position + 1, total)
    return generated, check
