"""A whole compiled decode step: an artifact built by `k3mk.compiler.pipeline.compile_artifact` (task
table format 3: weights, decode state and step inputs / outputs bound by name), run as exactly ONE
kernel launch per step.

    model = DecodeModel(artifact_dir, weights)          # weights: {canonical name: torch tensor} on the GPU
    next_tokens, logits = model.step(token_ids, positions)   # next_tokens: -1 where a request's logits are not finite

`weights` is e.g. `k3mk.compiler.random_weights.random_weights(config, seed, torch.bfloat16, "cuda")` or a
loaded checkpoint (names not in the artifact are ignored; every artifact weight must be there). The decode
state (KDA conv / recurrent state, MLA latent cache, layouts in the manifest's "state_layouts") is
allocated zeroed, or adopted from `states` (the caller's tensors, updated in place). Step inputs are
written into the arena as int32 by plain copies (a host-side conversion, never a kernel), so a step is
one cooperative launch; the returned tensors are views of the arena, valid until the next step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from k3mk.runtime.megakernel import Megakernel
from k3mk.runtime.tokens import mark_nonfinite


class DecodeModel:
    def __init__(self, artifact_dir: str | Path, weights: Mapping[str, torch.Tensor], states: Mapping[str, torch.Tensor] | None = None,
                 device: int | torch.device | None = None):  # fmt: skip
        self.mk = Megakernel(artifact_dir, device)
        m = self.mk.manifest
        names = [name for name, _, _ in self.mk.weight_specs]
        missing = [n for n in names if n not in weights]
        if missing:
            raise KeyError(f"weights missing for this artifact: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        self.mk.bind_weights({n: weights[n] for n in names})
        if states is None:
            self.states = self.mk.allocate_states()
        else:
            self.mk.bind_states(states)
            self.states = dict(states)
        self.batch = m.data.get("max_tokens")
        self.max_context = m.data.get("max_context")
        self.inputs = {b["name"]: b for b in m["buffers"] if b.get("role") == "input"}
        self.outputs = {b["name"]: b for b in m["buffers"] if b.get("role") == "output"}
        self._pinned = {n: torch.empty(b["shape"], dtype=torch.int32).pin_memory() for n, b in self.inputs.items()}

    def _write(self, name: str, value) -> None:
        dst = self.mk.buffer(name)
        if not torch.is_tensor(value):
            value = torch.tensor(value)
        value = value.reshape(dst.shape)
        if value.dtype != torch.int32 or value.device != dst.device:
            host = self._pinned[name]
            host.copy_(value.cpu())  # host-side int64 -> int32; then one H2D copy (no kernel)
            value = host
        dst.copy_(value, non_blocking=True)

    def step(self, token_ids, positions, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for every request: (next_tokens int32 [batch], logits [batch, vocab]), arena views.
        A request whose logits hold a NaN or an Inf gets NONFINITE_TOKEN (-1) instead of a token
        (k3mk.runtime.tokens; three small torch kernels after the launch, on its stream): never feed it back
        as a token id. `check_finite=False` leaves the kernel's argmax as it is (exactly one launch: step-time
        measurements, loops that feed the tokens back)."""
        self._write("token_ids", token_ids)
        self._write("positions", positions)
        self.mk.step()
        next_tokens, logits = self.mk.buffer("next_tokens"), self.mk.buffer("logits")
        if check_finite:
            mark_nonfinite(next_tokens, logits)
        return next_tokens, logits

    def buffer(self, name: str) -> torch.Tensor:
        return self.mk.buffer(name)
