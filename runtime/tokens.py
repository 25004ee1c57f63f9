"""What a decode step hands back per request: its greedy next token, or NONFINITE_TOKEN where that
request's logits are not all finite. A NaN or an Inf anywhere in a row makes its argmax meaningless
(all-NaN logits give token 0, which looks like a normal token), so the step reports the row instead.
Shared by the reference generation (k3mk.compiler.generate) and the megakernel runtime (DecodeModel,
TPRank), so the two report alike."""

from __future__ import annotations

import torch

NONFINITE_TOKEN = -1  # never a token id


def mark_nonfinite(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`tokens` (integer [batch]) with NONFINITE_TOKEN written, in place, into every row whose `logits`
    ([batch, vocab]) hold a NaN or an Inf. Runs on the logits' device and stream without a host
    synchronisation (capturable in a CUDA graph); returns `tokens`."""
    finite = torch.isfinite(logits).all(dim=-1).view(tokens.shape)
    return tokens.masked_fill_(~finite, NONFINITE_TOKEN)
