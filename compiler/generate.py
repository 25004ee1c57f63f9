"""Greedy generation with the reference decode step: the prompt is fed one token per decode step
(exactly the step the megakernel will run), then each step's argmax is fed back.

This is the end-to-end check of the whole numerics path on real-shaped inputs today, and the
oracle the compiled kernel's generations will be compared with later.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from k3mk.compiler.config import ModelConfig
from k3mk.compiler.ops import k3mk
from k3mk.compiler.reference import DecodeStep
from k3mk.runtime.tokens import NONFINITE_TOKEN, mark_nonfinite


class NonFiniteLogits(ValueError):
    """A decode step produced NaN or Inf logits: no token can be chosen."""


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
