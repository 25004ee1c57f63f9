"""Seeded random weights for any config (canonical names, compiler/weights.py) and random checkpoints
in the published format: stand-ins for real weights in tests and benchmarks, built so that the decode
step behaves like a trained model in the ways the compiler can get wrong.

Determinism: each tensor is drawn from its own `torch.Generator` on `device`, seeded from
(seed, tensor name), so a tensor does not depend on which others exist (a layer slice of a config has
the full model's weights for those layers) and a 48B model can be generated on the GPU tensor by
tensor. CPU and CUDA generators give different values. Every floating value is rounded to bf16, so a
bf16 checkpoint holds the weights exactly and float32 and bf16 runs see the same weights.

Scales (checked with the reference step on k3-tiny, kimi-k3-0.40b, layer slices of kimi-linear-48b
and k3-proxy-16l at full width, and all 93 / 27 layers of kimi-k3 / kimi-linear at narrow width: the
input RMS of every RMSNorm stays within 0.1..3.5 over 8 decode steps, logits RMS ~1):
- linear weights N(0, 1/fan_in), so a projection keeps the RMS of its input; the projections that
  write into the residual stream (o_proj, dense and shared down_proj, routed_expert_up_proj, expert
  w2) are scaled by OUTPUT_SCALE so the stream grows slowly over 27 plain-residual layers (Kimi
  Linear: RMS 2 -> 3.4) and block prefixes stay O(1) (K3);
- embeddings of RMS EMBED_RMS; norm gains 1 + N(0, 0.1^2); the AttnRes projections give
  depth-softmax scores of std ATTN_RES_SCORE_STD, so no source dominates or vanishes (spec 6);
- KDA: A_log in [-0.3, 0.3], dt_bias in [-5, -2.5] and the low-rank decay input f of RMS 1/2 put the
  per-channel decays exp(g) mostly in (0.5, 1) for both gate forms (98% for K3's, all for Kimi
  Linear's; spec 3.2); conv taps N(0, 1/W).

Routing with clear margins (spec 5.2). With continuous router inputs the gap between the k-th and
(k+1)-th selection score has positive density at 0, so among hundreds of decisions some would be
near-ties that bf16 rounding flips. The weights therefore carry a discrete routing signal:
- C = ceil(E / k) orthonormal "code" directions (at most d / 4); every token has a random code, and
  its embedding a component of RMS CODE_SHARE * EMBED_RMS along that code's direction; the rest of the
  embedding, and every projection that writes into the residual stream, is orthogonal to all codes.
  So the only code content of any residual stream or AttnRes mix is the token's own code, carried
  by its embedding (the block-0 source of every mix, or the start of the plain residual stream).
- Each router row is ROUTER_GAIN / (CODE_SHARE sqrt(d)) times a per-expert gain in 1 +- ROUTER_GAIN_SPREAD
  times the sum of the code directions the expert serves (every code served by k experts, assigned
  per layer at random and balanced over experts), plus a small random part (logit std ROUTER_NOISE);
  the correction bias is N(0, CORRECTION_BIAS_STD^2).
A token's k experts get a logit of ROUTER_GAIN times the share of its embedding in the router input
(about 1 early, 0.1 deep in K3's 9-source mixes), every other expert 0 +- ~0.05. Measured (8 steps,
batch 4): the k-th minus (k+1)-th selection score is >= 0.36 (median 0.45) on k3-tiny, >= 0.38 over
27 Kimi Linear layers, >= 0.12 (median 0.29) over all 2,944 decisions of the 93-layer K3 schedule;
a bf16 run moves it by <= 1.1e-3 and picks the same experts as float32. Routing differs between
tokens (C sets per layer) and layers, and every expert is used when C * k >= E.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import Tensor

from k3mk.compiler.checkpoint import quantize_mxfp4, save_checkpoint
from k3mk.compiler.config import ModelConfig
from k3mk.compiler.weights import TensorSpec, weight_specs
from k3mk.ir.collectives import ShardSpec

OUTPUT_SCALE = 0.5
NORM_GAIN_STD = 0.1
ATTN_RES_SCORE_STD = 0.25
F_RMS = 0.5  # the KDA decay-gate input f = f_b(f_a(x))
EMBED_RMS = 2.0  # > 1 keeps the embedding, which carries the routing code, a large share of every AttnRes mix
CODE_SHARE = 0.7  # RMS of the routing-code component of an embedding row (the rest is noise)
ROUTER_GAIN = 6.0  # router logit of a token's own experts when its code survives in full
ROUTER_GAIN_SPREAD = 0.25  # per-expert gains in 1 +- this: uneven weights among a token's experts
ROUTER_NOISE = 0.03  # logit std from the random part of the router rows
CORRECTION_BIAS_STD = 0.01
QUANTIZE_CHUNK = 2**24  # floats per quantize_mxfp4 call when making MXFP4 experts

# Projections that write into the residual stream (expert w2 through the combine: under LatentMoE it
# writes into the latent instead, which routed_expert_up_proj maps into the stream).
_OUTPUTS = re.compile(r".*\.(o_proj|mlp\.down_proj|shared_experts\.down_proj|routed_expert_up_proj|experts\.w2)\.weight")


class _Draw:
    """Draws each kind of weight (module docstring) and holds the routing codes that the embedding,
    the routers and the residual output projections share."""

    def __init__(self, config: ModelConfig, seed: int, device: str | torch.device):
        self.config, self.seed, self.device = config, seed, torch.device(device)
        moe, d = config.moe, config.hidden_size
        self.num_codes = max(1, min(-(-moe.num_experts // moe.top_k), d // 4))
        g = self.generator("routing.codes")
        # orthonormal code directions, rows [C, d]
        self.codes = torch.linalg.qr(torch.randn(d, self.num_codes, generator=g, device=self.device)).Q.T.contiguous()

    def without_codes(self, t: Tensor) -> Tensor:
        """t [..., d] (rows in the residual space) with its component in the code subspace removed."""
        return t - (t @ self.codes.T) @ self.codes

    def generator(self, name: str) -> torch.Generator:
        digest = hashlib.sha256(f"{self.seed}/{name}".encode()).digest()
        g = torch.Generator(device=self.device)
        g.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        return g

    def randn(self, g: torch.Generator, *shape: int) -> Tensor:
        return torch.randn(shape, generator=g, device=self.device)

    def uniform(self, g: torch.Generator, low: float, high: float, *shape: int) -> Tensor:
        return low + (high - low) * torch.rand(shape, generator=g, device=self.device)

    def embedding(self, g: torch.Generator, vocab: int, d: int) -> Tensor:
        token_code = torch.randint(self.num_codes, (vocab,), generator=g, device=self.device)
        t = self.without_codes(self.randn(g, vocab, d)).mul_(math.sqrt(1 - CODE_SHARE**2))
        return t.add_(self.codes[token_code], alpha=CODE_SHARE * math.sqrt(d)).mul_(EMBED_RMS)

    def router(self, g: torch.Generator, experts: int, d: int) -> Tensor:
        top_k = self.config.moe.top_k
        serves = torch.zeros(experts, self.num_codes, device=self.device)
        for c in range(self.num_codes):  # each code gets the k least-used experts, ties broken at random
            key = serves.sum(1) + 0.5 * torch.rand(experts, generator=g, device=self.device)
            serves[key.topk(top_k, largest=False).indices, c] = 1.0
        gains = self.uniform(g, 1 - ROUTER_GAIN_SPREAD, 1 + ROUTER_GAIN_SPREAD, experts, 1)  # uneven routing weights
        rows = (serves * gains) @ self.codes * (ROUTER_GAIN / (CODE_SHARE * math.sqrt(d)))
        return rows + self.randn(g, experts, d) * (ROUTER_NOISE / math.sqrt(d))

    def linear(self, g: torch.Generator, name: str, out: int, inp: int) -> Tensor:
        output = _OUTPUTS.fullmatch(name) is not None
        scale = OUTPUT_SCALE if output else F_RMS if name.endswith(".f_b_proj.weight") else 1.0
        w = self.randn(g, out, inp) * (scale / math.sqrt(inp))
        if output and not (self.config.moe.latent_size and ".experts." in name):  # it writes into the stream
            w = self.without_codes(w.T).T
        return w

    def experts(self, name: str, shape: tuple[int, int, int]) -> Iterator[Tensor]:
        """Per-expert float weights [out, in] of a stacked expert tensor, drawn one expert at a time (the
        MXFP4 and bf16 forms of a config share them)."""
        g = self.generator(name)
        for _ in range(shape[0]):
            yield self.linear(g, name, shape[1], shape[2])

    def mxfp4_experts(self, name: str, packed_shape: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
        """MXFP4 bytes of random float experts, quantized a chunk of experts at a time (few large
        calls, yet only QUANTIZE_CHUNK floats at once)."""
        experts, out, half = packed_shape
        group = self.config.moe.mxfp4_group_size
        packed = torch.empty(packed_shape, dtype=torch.uint8, device=self.device)
        scale = torch.empty((experts, out, 2 * half // group), dtype=torch.uint8, device=self.device)
        draws = self.experts(name, (experts, out, 2 * half))
        chunk = max(1, QUANTIZE_CHUNK // (out * 2 * half))
        for start in range(0, experts, chunk):
            stop = min(start + chunk, experts)
            packed[start:stop], scale[start:stop] = quantize_mxfp4(torch.stack([next(draws) for _ in range(start, stop)]), group)
        return packed, scale

    def tensor(self, spec: TensorSpec) -> Tensor:
        name, shape = spec.name, spec.shape
        g = self.generator(name)
        if name == "model.embed_tokens.weight":
            return self.embedding(g, *shape)
        if name.endswith(".gate.weight"):
            return self.router(g, *shape)
        if name.endswith(".gate.e_score_correction_bias"):
            return self.randn(g, *shape) * CORRECTION_BIAS_STD
        if name.endswith("_res_proj.weight"):
            return self.randn(g, *shape) * (ATTN_RES_SCORE_STD / math.sqrt(shape[-1]))
        if name.endswith("norm.weight"):
            return 1.0 + NORM_GAIN_STD * self.randn(g, *shape)
        if name.endswith(".A_log"):
            return self.uniform(g, -0.3, 0.3, *shape)
        if name.endswith(".dt_bias"):
            return self.uniform(g, -5.0, -2.5, *shape)
        if name.endswith("_conv1d.weight"):
            return self.randn(g, *shape) / math.sqrt(shape[-1])
        if ".experts." in name:
            return torch.stack([w.to(torch.bfloat16) for w in self.experts(name, shape)])
        return self.linear(g, name, *shape)


def random_weights(
    config: ModelConfig,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    shards: Mapping[str, Mapping[str, int]] | None = None,
    rank: int = 0,
) -> dict[str, Tensor]:
    """Every weight of `config` under canonical names: floating weights in `dtype` (the "float32" kind
    in float32) with bf16-exact values, MXFP4 experts quantized from random float weights (module
    docstring for the scales and the routing structure). With `shards` (a tensor-parallel artifact's
    `tp_shards`), each weight named there is rank `rank`'s piece, cut as soon as it is drawn (so a rank
    holds its pieces and one full tensor at a time)."""
    draw = _Draw(config, seed, device)
    out: dict[str, Tensor] = {}

    def keep(name: str, t: Tensor) -> None:
        shard = (shards or {}).get(name)
        out[name] = ShardSpec(shard["dim"], shard["parts"], shard.get("groups", 1)).take(t, rank) if shard else t

    for spec in weight_specs(config):
        if spec.name in out:  # the scale half of an MXFP4 pair, made with its bytes
            continue
        if spec.name.endswith(".weight_packed"):
            base = spec.name.removesuffix(".weight_packed")
            for name, t in zip((spec.name, f"{base}.weight_scale"), draw.mxfp4_experts(f"{base}.weight", spec.shape)):
                keep(name, t)
            continue
        keep(spec.name, draw.tensor(spec).to(torch.bfloat16).to(spec.torch_dtype(dtype)))
    return out


def write_random_checkpoint(
    config: ModelConfig, directory: str | Path, seed: int, *, config_json: dict[str, Any] | None = None, max_shard_bytes: int = 5 * 2**30
) -> Path:
    """`random_weights(config, seed)` saved as a published-format checkpoint with the config's own JSON
    (its preset or source file; `config_json` for a config built in code)."""
    return save_checkpoint(config, random_weights(config, seed), directory, max_shard_bytes=max_shard_bytes, config_json=config_json)
