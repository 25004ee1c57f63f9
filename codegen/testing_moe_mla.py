"""Test mode for the MoE and MLA Kimi ops: `TableBuilder` methods (mixed into codegen/testing.py's
TableBuilder) for the router (fused.router), the routed experts (fused.expert_gated_linear[_mxfp4],
fused.expert_linear[_mxfp4]_combine) and the absorbed MLA decode (semantics.mla_latent +
mla_cache_write, fused.mla_q_absorb, fused.mla_decode, fused.mla_v_up). Each method emits the tasks of
one op and registers its reference step, computed with k3mk.ir.semantics / k3mk.ir.fused.

The MLA latent cache is decode state (a pointer-table entry bound by name, updated in place): it is
recorded in `self.states`; a reference step reads it from the environment when an earlier op of the
table wrote it, else from the bound tensors, and stores the new cache in the environment.
"""

from __future__ import annotations

import torch

from k3mk.ir import fused, semantics
from k3mk.ir.task_table import (
    ExpertCombineParams,
    ExpertGatedParams,
    GemvParams,
    MlaDecodeParams,
    MlaLatentParams,
    MlaQAbsorbParams,
    MlaVUpParams,
    RouterParams,
)


def _state(env: dict, weights: dict, name: str) -> torch.Tensor:
    return env[name] if name in env else weights[name]


def _expert_linear(x: torch.Tensor, weights: dict, w_name: str, s_name: str | None, ids: torch.Tensor) -> torch.Tensor:
    if s_name is None:
        return semantics.expert_linear(x, weights[w_name], ids)
    return semantics.expert_linear_mxfp4(x, weights[w_name], weights[s_name], ids)


class MoeMlaOpsMixin:
    """Methods of codegen.testing.TableBuilder (which provides buffer/weight/event/_opcode/_emit/_steps)."""

    # ---- router (spec 5.2) ----------------------------------------------------------------------
    def router(self, x, weight: int, bias: int, ids, topk_weights, *, top_k: int, renormalize: bool = True,
               scaling: float = 1.0, norm_weight: int | None = None, eps: float = 1e-5, wait: tuple[int, ...] = (),
               cta: int | None = None, tiles: int = 0, name: str = "router") -> int:  # fmt: skip
        """ids int32 [B, k] and topk_weights fp32 [B, k] of fused.router: ONE task, or with `tiles` a row-tiled
        fp32 gemv of the logits whose last tile to arrive selects (GemvParams "router", as
        passes/emit_task_table.py folds a router_topk), its tiles spread over the CTAs from `cta` on."""
        batch, dim = x.shape
        num_experts = self.weights[weight].shape[0]
        ev = self.event(name)
        if tiles:
            from k3mk.codegen.testing import _split

            logits = self.buffer(f"{name}_logits", "float32", (batch, num_experts))
            params = GemvParams(dim, num_experts, batch, rmsnorm=norm_weight is not None, eps=eps, epilogue="router",
                                out_dtype="float32", top_k=top_k, renormalize=renormalize, scaling=scaling)  # fmt: skip
            opcode = self._opcode("gemv", params)
            arrivals = self.event(f"{name} arrivals")
            parts = _split(num_experts, tiles)
            for i, (begin, count) in enumerate(parts):
                operands = {"x": x.offset, "out": logits.offset, "weight": weight, "row_begin": begin, "row_count": count,
                            "batch_stride": num_experts,
                            "bias": bias, "ids": ids.offset, "topk_weights": topk_weights.offset, "arrivals": arrivals,
                            "tiles": len(parts)}  # fmt: skip
                if norm_weight is not None:
                    operands["norm_weight"] = norm_weight
                self._emit(opcode, operands, wait, ev, f"{name}[{i}]", None if cta is None else (cta + i) % self.num_ctas)
        else:
            params = RouterParams(dim, num_experts, batch, top_k, renormalize, scaling, norm_weight is not None, eps)
            opcode = self._opcode("router", params)
            operands = {"x": x.offset, "ids": ids.offset, "topk_weights": topk_weights.offset, "weight": weight, "bias": bias}
            if norm_weight is not None:
                operands["norm_weight"] = norm_weight
            self._emit(opcode, operands, wait, ev, f"{name}[0]", cta)
        self.ids_writer[ids.offset] = ev  # the routed experts' producers wait for it (their weight wait)
        w_name, b_name = self.weights[weight].name, self.weights[bias].name
        g_name = None if norm_weight is None else self.weights[norm_weight].name

        def step(env, weights):
            xs = [env[x.name]] if g_name is None else [env[x.name], weights[g_name]]
            env[ids.name], env[topk_weights.name] = fused.router(
                xs, weights[w_name], weights[b_name], None if g_name is None else eps, top_k, renormalize, scaling
            )

        self._steps.append(step)
        return ev

    # ---- routed experts (spec 5.3, 5.5) ---------------------------------------------------------
    def expert_gated(self, x, ids, out, w_gate: int, w_up: int, *, scale_gate: int | None = None,
                     scale_up: int | None = None, activation: str = "silu", beta: float = 4.0,
                     linear_beta: float | None = 25.0, row_tiles: int = 1, wait: tuple[int, ...] = (),
                     name: str = "expert_gated") -> int:  # fmt: skip
        """out [B, k, n] = act(w1[ids] x, w3[ids] x) per slot; tasks = k slots x row_tiles."""
        from k3mk.codegen.testing import _split

        batch, k_in = x.shape
        top_k = ids.shape[1]
        num_experts, n = self.weights[w_gate].shape[:2]
        fmt = "bfloat16" if scale_gate is None else "mxfp4"
        params = ExpertGatedParams(k_in, n, num_experts, batch, top_k, fmt, activation, beta, linear_beta)
        opcode = self._opcode("expert_gated", params)
        ev = self.event(name)
        for j in range(top_k):
            for i, (begin, count) in enumerate(_split(n, row_tiles)):
                operands = {"x": x.offset, "ids": ids.offset, "out": out.offset, "weight": w_gate, "weight_up": w_up,
                            "slot": j, "row_begin": begin, "row_count": count}  # fmt: skip
                if scale_gate is not None:
                    operands.update(scale=scale_gate, scale_up=scale_up)
                self._emit(opcode, operands, wait, ev, f"{name}[{j},{i}]", None, self.ids_writer.get(ids.offset))
        names = [None if w is None else self.weights[w].name for w in (w_gate, scale_gate, w_up, scale_up)]

        def step(env, weights):
            e_ids = env[ids.name]
            gate = _expert_linear(env[x.name], weights, names[0], names[1], e_ids)
            up = _expert_linear(env[x.name], weights, names[2], names[3], e_ids)
            if activation == "silu":
                env[out.name] = semantics.silu_mul(gate, up)
            else:
                env[out.name] = semantics.situ_mul(gate, up, beta, linear_beta)

        self._steps.append(step)
        return ev

    def expert_combine(self, x, ids, topk_weights, out, w_down: int, *, scale: int | None = None, row_tiles: int = 1,
                       residuals: tuple = (), wait: tuple[int, ...] = (), name: str = "expert_combine") -> int:  # fmt: skip
        """out [B, d] = moe_combine(w2[ids] x_j, topk_weights), then + each of `residuals` (bf16 [B, d] buffers,
        in order, one rounding each); tasks = row tiles (all slots each)."""
        from k3mk.ir.task_table import COMBINE_RESIDUAL_OPERANDS

        from k3mk.codegen.testing import _split

        batch, top_k, k_in = x.shape
        num_experts, n = self.weights[w_down].shape[:2]
        fmt = "bfloat16" if scale is None else "mxfp4"
        params = ExpertCombineParams(k_in, n, num_experts, batch, top_k, fmt, len(residuals))
        opcode = self._opcode("expert_combine", params)
        ev = self.event(name)
        for i, (begin, count) in enumerate(_split(n, row_tiles)):
            operands = {"x": x.offset, "ids": ids.offset, "topk_weights": topk_weights.offset, "out": out.offset,
                        "weight": w_down, "row_begin": begin, "row_count": count}  # fmt: skip
            if scale is not None:
                operands["scale"] = scale
            operands.update({k: r.offset for k, r in zip(COMBINE_RESIDUAL_OPERANDS, residuals)})
            self._emit(opcode, operands, wait, ev, f"{name}[{i}]", None, self.ids_writer.get(ids.offset))
        w_name = self.weights[w_down].name
        s_name = None if scale is None else self.weights[scale].name

        def step(env, weights):
            y = semantics.moe_combine(_expert_linear(env[x.name], weights, w_name, s_name, env[ids.name]), env[topk_weights.name])
            for r in residuals:
                y = semantics.add(env[r.name], y)
            env[out.name] = y

        self._steps.append(step)
        return ev

    # ---- absorbed MLA decode (spec 4.3) ----------------------------------------------------------
    def mla_latent(self, c, positions, norm_weight: int, cache: int, *, eps: float = 1e-6, tasks: int = 1,
                   wait: tuple[int, ...] = (), name: str = "mla_latent") -> int:  # fmt: skip
        """cache[b, positions[b]] = mla_latent(c[b]) (RMSNorm of c_kv || k_pe)."""
        from k3mk.codegen.testing import _split

        batch, width = c.shape
        rank = self.weights[norm_weight].shape[0]
        max_len = self.weights[cache].shape[1]
        opcode = self._opcode("mla_latent", MlaLatentParams(rank, width - rank, max_len, batch, eps))
        ev = self.event(name)
        for i, (begin, count) in enumerate(_split(batch, tasks)):
            operands = {"x": c.offset, "positions": positions.offset, "norm_weight": norm_weight, "cache": cache,
                        "batch_begin": begin, "batch_count": count}  # fmt: skip
            self._emit(opcode, operands, wait, ev, f"{name}[{i}]", None)
        g_name, cache_name = self.weights[norm_weight].name, self.weights[cache].name
        self.states.append(cache_name)

        def step(env, weights):
            row = semantics.mla_latent(env[c.name], weights[g_name], rank, eps)
            env[cache_name] = semantics.mla_cache_write(_state(env, weights, cache_name), row, env[positions.name])

        self._steps.append(step)
        return ev

    def mla_q_absorb(self, q, kv_b: int, out, *, num_heads: int, qk_nope: int, qk_rope: int, v_dim: int,
                     head_tiles: int = 1, column_tiles: int = 1, wait: tuple[int, ...] = (), name: str = "mla_q_absorb") -> int:  # fmt: skip
        """out [B, H, rank+rope] = fused.mla_q_absorb(q, kv_b); tasks = head tiles, or with column_tiles > 1 one head's
        q_lat columns in column_tiles equal pieces (as passes/tile.py cuts q_absorb when heads leave SMs idle)."""
        from k3mk.codegen.testing import _split

        batch = q.shape[0]
        rank = self.weights[kv_b].shape[1]
        columns = rank // column_tiles if column_tiles > 1 else 0
        params = MlaQAbsorbParams(num_heads, qk_nope, qk_rope, v_dim, rank, batch, columns=columns)
        opcode = self._opcode("mla_q_absorb", params)
        ev = self.event(name)
        if column_tiles > 1:
            tiles = [(h, 1, c * columns) for h in range(num_heads) for c in range(column_tiles)]
        else:
            tiles = [(begin, count, 0) for begin, count in _split(num_heads, head_tiles)]
        for i, (begin, count, c0) in enumerate(tiles):
            operands = {"x": q.offset, "out": out.offset, "weight": kv_b, "head_begin": begin, "head_count": count,
                        "column_begin": c0}  # fmt: skip
            self._emit(opcode, operands, wait, ev, f"{name}[{i}]", None)
        w_name = self.weights[kv_b].name
        self._steps.append(lambda env, w: env.__setitem__(out.name, fused.mla_q_absorb(env[q.name], w[w_name], num_heads, qk_nope, v_dim)))
        return ev

    def mla_decode(self, q, positions, cache: int, o, lse, *, num_chunks: int, min_chunk_rows: int, scale: float,
                   group_heads: int = 8, wait: tuple[int, ...] = (), name: str = "mla_decode") -> int:  # fmt: skip
        """(o [B, K, H, rank], lse [B, K, H]) = fused.mla_decode; tasks = requests x chunks x head groups."""
        batch, num_heads, width = q.shape
        _, max_len, _ = self.weights[cache].shape
        rank = o.shape[-1]
        params = MlaDecodeParams(num_heads, rank, width - rank, max_len, batch, num_chunks, min_chunk_rows, scale, group_heads)
        opcode = self._opcode("mla_decode", params)
        ev = self.event(name)
        for b in range(batch):
            for c in range(num_chunks):
                for h0 in range(0, num_heads, group_heads):
                    operands = {"q": q.offset, "positions": positions.offset, "out": o.offset, "lse": lse.offset,
                                "cache": cache, "request": b, "chunk": c, "head_begin": h0,
                                "head_count": min(group_heads, num_heads - h0)}  # fmt: skip
                    self._emit(opcode, operands, wait, ev, f"{name}[{b},{c},{h0}]", None)
        cache_name = self.weights[cache].name

        def step(env, weights):
            env[o.name], env[lse.name] = fused.mla_decode(env[q.name], _state(env, weights, cache_name), env[positions.name],
                                                          rank, num_chunks, min_chunk_rows, scale)  # fmt: skip

        self._steps.append(step)
        return ev

    def mla_v_up(self, o, lse, kv_b: int, out, *, qk_nope: int, v_dim: int, head_tiles: int = 1, value_tiles: int = 1,
                 wait: tuple[int, ...] = (), name: str = "mla_v_up") -> int:  # fmt: skip
        """out [B, H*v] = fused.mla_v_up(o, lse, kv_b); tasks = head tiles (every request each), or with value_tiles > 1
        one head's output rows in value_tiles pieces (as passes/tile.py cuts v_up when heads leave SMs idle)."""
        from k3mk.codegen.testing import _split

        batch, num_chunks, num_heads, rank = o.shape
        params = MlaVUpParams(num_heads, qk_nope, v_dim, rank, batch, num_chunks)
        opcode = self._opcode("mla_v_up", params)
        ev = self.event(name)
        if value_tiles > 1:
            tiles = [(h, 1, v0, vc) for h in range(num_heads) for v0, vc in _split(v_dim, value_tiles)]
        else:
            tiles = [(begin, count, 0, v_dim) for begin, count in _split(num_heads, head_tiles)]
        for i, (begin, count, v0, vc) in enumerate(tiles):
            operands = {"o": o.offset, "lse": lse.offset, "out": out.offset, "weight": kv_b, "head_begin": begin,
                        "head_count": count, "value_begin": v0, "value_count": vc}  # fmt: skip
            self._emit(opcode, operands, wait, ev, f"{name}[{i}]", None)
        w_name = self.weights[kv_b].name
        self._steps.append(lambda env, w: env.__setitem__(out.name, fused.mla_v_up(env[o.name], env[lse.name], w[w_name], num_heads, qk_nope, v_dim)))
        return ev
