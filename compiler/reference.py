"""The reference decode step: one step of B requests (one new token each) of Kimi K3 or Kimi Linear,
written in `torch.ops.k3mk.*` (compiler/ops.py) so that `torch.export` captures it op for op.

It is the numerics oracle of the compiler (spec section 2 for the step, 3 KDA, 4 MLA, 5 FFN, 6 block
attention residuals, 9 fp32 islands) and is written capture-friendly: no Python control flow on tensor
values, experts stacked and indexed by the router's choices, a fixed-size latent cache masked by the
positions. All weights are buffers named by their canonical names (compiler/weights.py), so
`state_dict()` keys are exactly those names.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3mk.compiler.config import ModelConfig
from k3mk.compiler.ops import k3mk
from k3mk.compiler.weights import TensorSpec, state_specs, weight_specs


class DecodeStep(nn.Module):
    """forward(token_ids [B] int64, positions [B] int64, state {name: tensor}) -> (logits [B, V], new state).

    `positions[b]` is the number of tokens request b already has in its cache (its new token's 0-based
    position). The state dict follows `state_specs`; the returned dict has the same keys."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        self.config, self.dtype = config, dtype
        self.specs = weight_specs(config)
        for spec in self.specs:
            self._register(spec, torch.empty(spec.shape, dtype=spec.torch_dtype(dtype), device=device))

    def _register(self, spec: TensorSpec, tensor: Tensor) -> None:
        *path, leaf = spec.name.split(".")
        module: nn.Module = self
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_buffer(leaf, tensor)

    def w(self, name: str) -> Tensor:
        return self.get_buffer(name)

    def new_state(self, batch: int, max_context: int, device: str | torch.device | None = None) -> dict[str, Tensor]:
        """Zero decode state of empty requests."""
        device = device or self.w("lm_head.weight").device
        return {
            s.name: torch.zeros(s.shape, dtype=s.torch_dtype(self.dtype), device=device)
            for s in state_specs(self.config, batch, max_context)
        }

    # --- mixers -----------------------------------------------------------------------------------
    def _kda(self, i: int, x: Tensor, state: dict[str, Tensor], new: dict[str, Tensor]) -> Tensor:
        c, p = self.config.kda, f"model.layers.{i}.self_attn"
        w = lambda n: self.w(f"{p}.{n}")  # noqa: E731
        q, k, v = (k3mk.linear(x, w(f"{n}_proj.weight"), False) for n in ("q", "k", "v"))
        q, k, v, new[f"layers.{i}.conv_state"] = k3mk.kda_conv(
            q, k, v, state[f"layers.{i}.conv_state"], w("q_conv1d.weight"), w("k_conv1d.weight"), w("v_conv1d.weight")
        )
        f = k3mk.linear(k3mk.linear(x, w("f_a_proj.weight"), False), w("f_b_proj.weight"), False)
        g = k3mk.kda_gate(f, w("A_log"), w("dt_bias"), c.num_heads, c.gate_lower_bound)
        beta = k3mk.linear(x, w("b_proj.weight"), False)
        o, new[f"layers.{i}.recurrent_state"] = k3mk.kda_recurrence(q, k, v, g, beta, state[f"layers.{i}.recurrent_state"])
        if c.full_rank_output_gate:
            gate = k3mk.linear(x, w("g_proj.weight"), False)
        else:
            gate = k3mk.linear(k3mk.linear(x, w("g_a_proj.weight"), False), w("g_b_proj.weight"), False)
        o = k3mk.gated_rmsnorm(o, gate, w("o_norm.weight"), c.head_dim, self.config.rms_norm_eps)
        return k3mk.linear(o, w("o_proj.weight"), False)

    def _mla(self, i: int, x: Tensor, positions: Tensor, state: dict[str, Tensor], new: dict[str, Tensor]) -> Tensor:
        m, p = self.config.mla, f"model.layers.{i}.self_attn"
        w = lambda n: self.w(f"{p}.{n}")  # noqa: E731
        if m.q_lora_rank:
            qa = k3mk.rmsnorm(k3mk.linear(x, w("q_a_proj.weight"), False), w("q_a_layernorm.weight"), m.latent_norm_eps)
            q = k3mk.linear(qa, w("q_b_proj.weight"), False)
        else:
            q = k3mk.linear(x, w("q_proj.weight"), False)
        row = k3mk.mla_latent(k3mk.linear(x, w("kv_a_proj_with_mqa.weight"), False), w("kv_a_layernorm.weight"), m.kv_lora_rank, m.latent_norm_eps)
        cache = k3mk.mla_cache_write(state[f"layers.{i}.kv_cache"], row, positions)
        new[f"layers.{i}.kv_cache"] = cache
        o = k3mk.mla_attention(
            q, cache, positions, w("kv_b_proj.weight"), m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        )
        if m.output_gate:
            o = k3mk.sigmoid_gate(o, k3mk.linear(x, w("g_proj.weight"), False))
        return k3mk.linear(o, w("o_proj.weight"), False)

    # --- feed-forward -----------------------------------------------------------------------------
    def _act_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        c = self.config
        if c.activation == "situ":
            return k3mk.situ_mul(gate, up, c.situ_beta, c.situ_linear_beta)
        return k3mk.silu_mul(gate, up)

    def _mlp(self, prefix: str, x: Tensor) -> Tensor:
        w = lambda n: self.w(f"{prefix}.{n}_proj.weight")  # noqa: E731
        return k3mk.linear(self._act_mul(k3mk.linear(x, w("gate"), False), k3mk.linear(x, w("up"), False)), w("down"), False)

    def _experts(self, prefix: str, proj: str, x: Tensor, ids: Tensor) -> Tensor:
        base = f"{prefix}.experts.{proj}"
        if self.config.moe.expert_format == "mxfp4":
            return k3mk.expert_linear_mxfp4(x, self.w(f"{base}.weight_packed"), self.w(f"{base}.weight_scale"), ids)
        return k3mk.expert_linear(x, self.w(f"{base}.weight"), ids)

    def _moe(self, i: int, x: Tensor) -> Tensor:
        moe, p = self.config.moe, f"model.layers.{i}.block_sparse_moe"
        logits = k3mk.linear(x, self.w(f"{p}.gate.weight"), True)
        ids, weights = k3mk.router_topk(logits, self.w(f"{p}.gate.e_score_correction_bias"), moe.top_k, moe.renormalize, moe.routed_scaling_factor)
        z = k3mk.linear(x, self.w(f"{p}.routed_expert_down_proj.weight"), False) if moe.latent_size else x
        a = self._act_mul(self._experts(p, "w1", z, ids), self._experts(p, "w3", z, ids))
        y = k3mk.moe_combine(self._experts(p, "w2", a, ids), weights)
        if moe.latent_size:
            if moe.latent_norm:
                y = k3mk.rmsnorm(y, self.w(f"{p}.routed_expert_norm.weight"), self.config.rms_norm_eps)
            y = k3mk.linear(y, self.w(f"{p}.routed_expert_up_proj.weight"), False)
        if moe.num_shared_experts:
            y = k3mk.add(y, self._mlp(f"{p}.shared_experts", x))
        return y

    # --- the step ---------------------------------------------------------------------------------
    def _layer_parts(self, i: int, positions: Tensor, state: dict[str, Tensor], new: dict[str, Tensor]):
        c, p = self.config, f"model.layers.{i}"
        eps = c.rms_norm_eps

        def mixer(h: Tensor) -> Tensor:
            x = k3mk.rmsnorm(h, self.w(f"{p}.input_layernorm.weight"), eps)
            return self._kda(i, x, state, new) if c.layer_kinds[i] == "kda" else self._mla(i, x, positions, state, new)

        def ffn(h: Tensor) -> Tensor:
            x = k3mk.rmsnorm(h, self.w(f"{p}.post_attention_layernorm.weight"), eps)
            return self._moe(i, x) if c.is_moe_layer(i) else self._mlp(f"{p}.mlp", x)

        return mixer, ffn

    def _mix(self, prefix: str, sources: list[Tensor]) -> Tensor:
        return k3mk.attn_res(sources, self.w(f"{prefix}_res_norm.weight"), self.w(f"{prefix}_res_proj.weight"), self.config.rms_norm_eps)

    def forward(self, token_ids: Tensor, positions: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        c = self.config
        new: dict[str, Tensor] = {}
        x0 = k3mk.embedding(self.w("model.embed_tokens.weight"), token_ids)
        if c.attn_res_block_size is None:  # classic pre-norm residual (Kimi Linear)
            h = x0
            for i in range(c.num_layers):
                mixer, ffn = self._layer_parts(i, positions, state, new)
                h = k3mk.add(h, mixer(h))
                h = k3mk.add(h, ffn(h))
        else:  # block attention residuals (K3, spec 2 and 6)
            blocks: list[Tensor] = []
            prefix: Tensor | None = x0
            for i in range(c.num_layers):
                mixer, ffn = self._layer_parts(i, positions, state, new)
                p = f"model.layers.{i}"
                h = self._mix(f"{p}.self_attention", blocks + [prefix]) if blocks else prefix
                if i % c.attn_res_block_size == 0:  # close a block: snapshot the pre-mix prefix
                    blocks.append(prefix)
                    prefix = None
                a = mixer(h)
                prefix = a if prefix is None else k3mk.add(prefix, a)
                prefix = k3mk.add(prefix, ffn(self._mix(f"{p}.mlp", blocks + [prefix])))
            h = self._mix("model.output_attn", blocks + [prefix])
        logits = k3mk.linear(k3mk.rmsnorm(h, self.w("model.norm.weight"), c.rms_norm_eps), self.w("lm_head.weight"), False)
        return logits, new
