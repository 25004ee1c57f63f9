"""The weight and decode-state tables of a model config: every tensor's canonical name, shape and dtype.

Canonical weight names are the checkpoint names without the `language_model.` prefix of K3
(models/TENSORS.md), except that routed experts are STACKED over the expert index
(`...experts.w1.weight` [E, out, in] instead of `...experts.{e}.w1.weight`), which is how the
reference indexes them by the router's choices. The checkpoint loader maps between the two.

Weight dtypes: "compute" (the model dtype: bf16 or fp32), "float32" (the spec's fp32 parameters:
conv weights, A_log, dt_bias, o_norm, the router correction bias; spec 3.1, 9) or "uint8" (MXFP4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from k3mk.compiler.config import ModelConfig

DTypeKind = Literal["compute", "float32", "uint8"]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: DTypeKind

    def torch_dtype(self, compute: torch.dtype) -> torch.dtype:
        return {"compute": compute, "float32": torch.float32, "uint8": torch.uint8}[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


EXPERT_PROJS = ("w1", "w2", "w3")  # w1 gate [I, in], w3 up [I, in], w2 down [in, I] (spec 5.3)


def expert_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Per-expert [out, in] of w1/w2/w3; the experts run in the latent width under LatentMoE."""
    width = config.moe.latent_size or config.hidden_size
    inter = config.moe.intermediate_size
    return {"w1": (inter, width), "w2": (width, inter), "w3": (inter, width)}


def _mlp(prefix: str, d: int, inter: int) -> list[TensorSpec]:
    return [
        TensorSpec(f"{prefix}.gate_proj.weight", (inter, d), "compute"),
        TensorSpec(f"{prefix}.up_proj.weight", (inter, d), "compute"),
        TensorSpec(f"{prefix}.down_proj.weight", (d, inter), "compute"),
    ]


def _kda(prefix: str, config: ModelConfig) -> list[TensorSpec]:
    k, d = config.kda, config.hidden_size
    p, hd = k.proj_size, k.head_dim
    out = [TensorSpec(f"{prefix}.{n}_proj.weight", (p, d), "compute") for n in ("q", "k", "v")]
    out += [TensorSpec(f"{prefix}.{n}_conv1d.weight", (p, 1, k.conv_size), "float32") for n in ("q", "k", "v")]
    out += [
        TensorSpec(f"{prefix}.A_log", (k.num_heads,), "float32"),
        TensorSpec(f"{prefix}.f_a_proj.weight", (hd, d), "compute"),
        TensorSpec(f"{prefix}.f_b_proj.weight", (p, hd), "compute"),
        TensorSpec(f"{prefix}.dt_bias", (p,), "float32"),
        TensorSpec(f"{prefix}.b_proj.weight", (k.num_heads, d), "compute"),
    ]
    if k.full_rank_output_gate:
        out.append(TensorSpec(f"{prefix}.g_proj.weight", (p, d), "compute"))
    else:
        out += [
            TensorSpec(f"{prefix}.g_a_proj.weight", (hd, d), "compute"),
            TensorSpec(f"{prefix}.g_b_proj.weight", (p, hd), "compute"),
        ]
    out += [
        TensorSpec(f"{prefix}.o_norm.weight", (hd,), "float32"),
        TensorSpec(f"{prefix}.o_proj.weight", (d, p), "compute"),
    ]
    return out


def _mla(prefix: str, config: ModelConfig) -> list[TensorSpec]:
    m, d = config.mla, config.hidden_size
    qk = m.num_heads * m.qk_head_dim
    if m.q_lora_rank:
        out = [
            TensorSpec(f"{prefix}.q_a_proj.weight", (m.q_lora_rank, d), "compute"),
            TensorSpec(f"{prefix}.q_a_layernorm.weight", (m.q_lora_rank,), "compute"),
            TensorSpec(f"{prefix}.q_b_proj.weight", (qk, m.q_lora_rank), "compute"),
        ]
    else:
        out = [TensorSpec(f"{prefix}.q_proj.weight", (qk, d), "compute")]
    out += [
        TensorSpec(f"{prefix}.kv_a_proj_with_mqa.weight", (m.cache_width, d), "compute"),
        TensorSpec(f"{prefix}.kv_a_layernorm.weight", (m.kv_lora_rank,), "compute"),
        TensorSpec(f"{prefix}.kv_b_proj.weight", (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), "compute"),
    ]
    if m.output_gate:
        out.append(TensorSpec(f"{prefix}.g_proj.weight", (m.num_heads * m.v_head_dim, d), "compute"))
    out.append(TensorSpec(f"{prefix}.o_proj.weight", (d, m.num_heads * m.v_head_dim), "compute"))
    return out


def _moe(prefix: str, config: ModelConfig) -> list[TensorSpec]:
    moe, d = config.moe, config.hidden_size
    out = [
        TensorSpec(f"{prefix}.gate.weight", (moe.num_experts, d), "compute"),
        TensorSpec(f"{prefix}.gate.e_score_correction_bias", (moe.num_experts,), "float32"),
    ]
    for proj, (o, i) in expert_shapes(config).items():
        base = f"{prefix}.experts.{proj}"
        if moe.expert_format == "mxfp4":
            out += [
                TensorSpec(f"{base}.weight_packed", (moe.num_experts, o, i // 2), "uint8"),
                TensorSpec(f"{base}.weight_scale", (moe.num_experts, o, i // moe.mxfp4_group_size), "uint8"),
            ]
        else:
            out.append(TensorSpec(f"{base}.weight", (moe.num_experts, o, i), "compute"))
    if moe.num_shared_experts:
        out += _mlp(f"{prefix}.shared_experts", d, moe.intermediate_size * moe.num_shared_experts)
    if moe.latent_size:
        out += [
            TensorSpec(f"{prefix}.routed_expert_down_proj.weight", (moe.latent_size, d), "compute"),
            TensorSpec(f"{prefix}.routed_expert_up_proj.weight", (d, moe.latent_size), "compute"),
        ]
        if moe.latent_norm:
            out.append(TensorSpec(f"{prefix}.routed_expert_norm.weight", (moe.latent_size,), "compute"))
    return out


def _attn_res(prefix: str, d: int) -> list[TensorSpec]:
    return [TensorSpec(f"{prefix}_res_norm.weight", (d,), "compute"), TensorSpec(f"{prefix}_res_proj.weight", (1, d), "compute")]


def weight_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every weight of the text model, in a stable order (model-level first, then layer by layer)."""
    d = config.hidden_size
    out = [
        TensorSpec("model.embed_tokens.weight", (config.vocab_size, d), "compute"),
        TensorSpec("model.norm.weight", (d,), "compute"),
        TensorSpec("lm_head.weight", (config.vocab_size, d), "compute"),
    ]
    if config.attn_res_block_size:
        out += _attn_res("model.output_attn", d)
    for i, kind in enumerate(config.layer_kinds):
        p = f"model.layers.{i}"
        out += [TensorSpec(f"{p}.input_layernorm.weight", (d,), "compute"), TensorSpec(f"{p}.post_attention_layernorm.weight", (d,), "compute")]
        if config.attn_res_block_size:
            out += _attn_res(f"{p}.self_attention", d) + _attn_res(f"{p}.mlp", d)
        out += _kda(f"{p}.self_attn", config) if kind == "kda" else _mla(f"{p}.self_attn", config)
        if config.is_moe_layer(i):
            out += _moe(f"{p}.block_sparse_moe", config)
        else:
            out += _mlp(f"{p}.mlp", d, config.dense_intermediate_size)
    return out


def state_specs(config: ModelConfig, batch: int, max_context: int) -> list[TensorSpec]:
    """Per-request decode state (spec 8): per KDA layer the conv state [B, W-1, 3P] (q|k|v, oldest
    first, model dtype) and the fp32 recurrent state [B, H, V, K]; per MLA layer the latent cache
    [B, max_context, kv_lora_rank + rope]. The token positions are a separate step input."""
    k, m = config.kda, config.mla
    out = []
    for i, kind in enumerate(config.layer_kinds):
        if kind == "kda":
            out += [
                TensorSpec(f"layers.{i}.conv_state", (batch, k.conv_size - 1, 3 * k.proj_size), "compute"),
                TensorSpec(f"layers.{i}.recurrent_state", (batch, k.num_heads, k.head_dim, k.head_dim), "float32"),
            ]
        else:
            out.append(TensorSpec(f"layers.{i}.kv_cache", (batch, max_context, m.cache_width), "compute"))
    return out
