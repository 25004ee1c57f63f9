"""CPU executor of a TASK TABLE (ir/task_table.py, format 3): runs the table's own tasks, from their
opcode, compile-time params and OPERAND WORDS (arena byte offsets into one flat byte arena, pointer-table
indices into the weights ++ states, tile coordinates), in an order its events allow, each with the
reference semantics of its op kind (ir/semantics.py / ir/fused.py, the compositions the templates
name). What the GPU runs is exactly this table: a wrong offset, weight id, state id, row range, head,
slot or chunk in the emitted operands shows up here as a wrong value (the arena starts poisoned with
0xFF bytes: NaN in every float format).

Each task computes its op on the WHOLE tensors its operands describe, as they are in memory when the
task runs, and stores only its tile, so the values are bit-identical to the interpreter's op by op. The
parts of the inputs outside the task's tile may not be written yet (a task waits only for the regions
it reads) or already updated in place (state): every op kind here is independent along the tiled axis,
so those parts only affect values the task discards. Pure torch, no CuTe DSL.

A tensor-parallel table runs in a `RankGroup`: one executor per rank, their comm regions wired like the
runtime wires the GPUs', the ranks in lockstep; a collective task runs the kernel's protocol on the
bytes (push into every rank's slot of this step's parity, count the pushes, reduce or assemble from
this rank's own slots), so wrong comm offsets, counters or rank indices show up as wrong values.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from k3mk.ir import collectives, fused, semantics
from k3mk.ir.ops import SiluMul, SituMul
from k3mk.ir.task_table import COLLECTIVE_OPS, COMBINE_RESIDUAL_OPERANDS, MAX_ATTN_RES_SOURCES, TaskTable

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8}
RESIDUALS = ("residual", "residual2", "residual3", "residual4")
# operands that only say which part of the op's result a task stores
TILE_OPERANDS = {"row_begin", "row_count", "batch_begin", "batch_count", "channel_begin", "channel_count", "head",
                 "value_begin", "value_count", "head_begin", "head_count", "request", "chunk", "begin", "count",
                 "col_begin", "col_count"}  # fmt: skip


class TableExecError(RuntimeError):
    pass


def table_order(table: TaskTable) -> list[tuple[int, int]]:
    """(list, position) of every task in an order the events allow (CTAs round-robin, one task at a time)."""
    counts = table.event_counts()
    seen = [0] * len(table.events)
    pos = [0] * len(table.lists)
    order = []
    progress = True
    while progress:
        progress = False
        for s, tasks in enumerate(table.lists):
            if pos[s] < len(tasks) and all(seen[e] >= counts[e] for e in tasks[pos[s]].wait):
                t = tasks[pos[s]]
                order.append((s, pos[s]))
                if t.signal is not None:
                    seen[t.signal] += 1
                pos[s] += 1
                progress = True
    if len(order) != table.num_tasks:
        raise TableExecError("the table deadlocks")
    return order


class TableExecutor:
    """`pointers`: the weights (by the table's weight names) and the states (by state names); the states
    are updated in place, as the kernel updates them. `inputs` of `step` by input buffer name."""

    def __init__(self, table: TaskTable, weights: Mapping[str, torch.Tensor], states: Mapping[str, torch.Tensor]):
        self.table = table
        self.pointers: list[torch.Tensor] = []
        for w in table.weights:
            t = weights[w.name]
            if t.dtype != DTYPES[w.dtype] or tuple(t.shape) != tuple(w.shape):
                raise TableExecError(f"weight {w.name}: {t.dtype}{list(t.shape)} vs {w.dtype}{list(w.shape)}")
            self.pointers.append(t)
        for st in table.states:
            t = states[st.name]
            if t.dtype != DTYPES[st.dtype] or tuple(t.shape) != tuple(st.shape):
                raise TableExecError(f"state {st.name}: {t.dtype}{list(t.shape)} vs {st.dtype}{list(st.shape)}")
            self.pointers.append(t)
        self.arena = torch.full((max(table.arena_bytes, 16),), 0xFF, dtype=torch.uint8)
        self.order = table_order(table)
        self.epoch = 0  # the step being run, 1-based (the kernel's epoch); 0 before the first
        self.arrivals: dict[int, int] = {}  # a router GEMV's arrival count (event id -> adds so far, every step)
        # this rank's comm region (tp > 1); a RankGroup appends every rank's to the pointer table
        self.comm = torch.zeros(table.comm.nbytes, dtype=torch.uint8) if table.comm else None

    # ---- memory ---------------------------------------------------------------------------------
    def buf(self, offset: int, dtype: str | torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
        n = dt.itemsize
        for s in shape:
            n *= s
        return self.arena[offset : offset + n].view(dt).view(tuple(shape))

    def buffer(self, name: str) -> torch.Tensor:
        b = self.table.buffer(name)
        return self.buf(b.offset, b.dtype, b.shape)

    def ptr(self, i: int) -> torch.Tensor:
        return self.pointers[i]

    # ---- running --------------------------------------------------------------------------------
    def step(self, inputs: Mapping[str, torch.Tensor]) -> None:
        self.begin_step(inputs)
        for s, i in self.order:
            self.run_task(s, i)

    def begin_step(self, inputs: Mapping[str, torch.Tensor]) -> None:
        for name, value in inputs.items():
            dst = self.buffer(name)
            dst.copy_(value.to(dst.dtype).view(dst.shape))
        self._memo: dict = {}
        self.epoch += 1

    def run_task(self, s: int, i: int, phase: str = "_op") -> None:
        """Task i of list s; `phase` "_push" runs a collective's first half (RankGroup)."""
        task = self.table.lists[s][i]
        v = self.table.variants[task.opcode]
        ops = {**dict.fromkeys(_operand_names(v.op), 0), **task.operands}
        key = (task.opcode, tuple(sorted((k, x) for k, x in ops.items() if k not in TILE_OPERANDS)))
        try:
            getattr(self, f"{phase}_{v.op}")(v.params, ops, key)
        except TableExecError:
            raise
        except Exception as e:  # noqa: BLE001
            raise TableExecError(f"list {s} task {i} ({task.label}): {type(e).__name__}: {e}") from e

    def _whole(self, key, fn, *reads: torch.Tensor):
        """fn(), the whole op on memory as it is now; reused for the next task of the same variant and
        non-tile operands (`key`) only if every tensor it `reads` (arena views, states) is equal bit for bit."""
        hit = self._memo.get(key)
        if hit is not None and len(hit[0]) == len(reads) and all(
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point else a,
                                                                        b.view(torch.uint8) if b.dtype.is_floating_point else b)
            for a, b in zip(hit[0], reads)
        ):
            return hit[1]
        value = fn()
        self._memo[key] = ([r.clone() for r in reads], value)
        return value

    # ---- op kinds (ir/task_table.py OP_KINDS; the compositions each template's header names) ---------
    def _op_nop(self, p, o, key) -> None:
        pass

    def _op_gemv(self, p, o, key) -> None:
        if p.x_stride:
            raise TableExecError("strided gemv operands are not modelled")
        B = p.batch
        x = self.buf(o["x"], "bfloat16", (B, p.in_features))
        W = self.ptr(o["weight"])
        xs = [x, self.ptr(o["norm_weight"])] if p.rmsnorm else [x]
        norm_eps = p.eps if p.rmsnorm else None

        def compute():
            if p.epilogue in ("none", "router"):
                if p.out_dtype == "float32":
                    return fused.rmsnorm_linear(x, xs[1], W, p.eps, True) if p.rmsnorm else semantics.linear(x, W, fp32=True)
                if p.residuals:
                    rs = [self.buf(o[RESIDUALS[i]], "bfloat16", (B, p.out_features)).clone() for i in range(p.residuals)]
                    xn = semantics.rmsnorm(x, xs[1], p.eps) if p.rmsnorm else x
                    return fused.linear_residual(rs, xn, W)
                return fused.rmsnorm_linear(x, xs[1], W, p.eps, False) if p.rmsnorm else semantics.linear(x, W)
            if p.epilogue in ("silu_mul", "situ_mul"):
                act = SituMul(p.beta, p.linear_beta) if p.epilogue == "situ_mul" else SiluMul()
                return fused.gated_linear(xs, W, self.ptr(o["weight_up"]), norm_eps, act)
            if p.epilogue == "sigmoid_gate":
                gate_o = self.buf(o["o"], "bfloat16", (B, p.out_features)).clone()
                return fused.linear_sigmoid_gate(xs, W, gate_o, norm_eps)
            if p.epilogue == "kda_gate":
                heads = p.out_features // p.head_dim
                g = fused.linear_kda_gate(xs, W, self.ptr(o["a_log"]), self.ptr(o["dt_bias"]), norm_eps, heads, p.lower_bound)
                return g.reshape(B, p.out_features)
            if p.epilogue == "gated_rmsnorm":
                gate_o = self.buf(o["o"], "bfloat16", (B, p.out_features)).clone()
                return fused.linear_gated_rmsnorm(xs, W, gate_o, self.ptr(o["o_norm_weight"]), norm_eps, p.head_dim, p.o_eps)
            raise TableExecError(f"gemv epilogue {p.epilogue!r}")

        reads = [x] + [self.buf(o[n], "bfloat16", (B, p.out_features)) for n in ("o", *RESIDUALS[: p.residuals]) if n in o and (n != "o" or p.epilogue in ("sigmoid_gate", "gated_rmsnorm"))]
        y = self._whole(key, compute, *reads)
        r0, rc = o["row_begin"], o["row_count"]
        self.buf(o["out"], p.out_dtype, (B, p.out_features))[:, r0 : r0 + rc] = y[:, r0 : r0 + rc]
        if p.epilogue == "router":
            # the kernel's arrival count (gemv.py.j2): the tile that completes the step's count selects, from
            # the logits in memory (every tile's, as they are now)
            e = o["arrivals"]
            self.arrivals[e] = self.arrivals.get(e, 0) + 1
            if self.arrivals[e] == o["tiles"] * self.epoch:
                logits = self.buf(o["out"], "float32", (B, p.out_features))
                ids, w = semantics.router_topk(logits, self.ptr(o["bias"]), p.top_k, p.renormalize, p.scaling)
                self.buf(o["ids"], "int32", (B, p.top_k))[:] = ids
                self.buf(o["topk_weights"], "float32", (B, p.top_k))[:] = w

    def _op_rmsnorm(self, p, o, key) -> None:
        x = self.buf(o["x"], "bfloat16", (p.batch, p.dim))
        y = self._whole(key, lambda: semantics.rmsnorm(x, self.ptr(o["weight"]), p.eps), x)
        b0, bc = o["batch_begin"], o["batch_count"]
        self.buf(o["out"], "bfloat16", (p.batch, p.dim))[b0 : b0 + bc] = y[b0 : b0 + bc]

    def _op_embedding(self, p, o, key) -> None:
        ids = self.buf(o["ids"], "int32", (p.batch,))
        table = self.ptr(o["table"])
        b0, bc = o["batch_begin"], o["batch_count"]
        self.buf(o["out"], "bfloat16", (p.batch, p.dim))[b0 : b0 + bc] = semantics.embedding(table, ids[b0 : b0 + bc].long())

    def _op_argmax(self, p, o, key) -> None:
        logits = self.buf(o["logits"], p.dtype, (p.batch, p.vocab))
        b0, bc = o["batch_begin"], o["batch_count"]
        self.buf(o["out"], "int32", (p.batch,))[b0 : b0 + bc] = semantics.argmax(logits[b0 : b0 + bc]).to(torch.int32)

    def _op_add(self, p, o, key) -> None:
        end = o["begin"] + o["count"]
        a, b, out = (self.buf(o[n], p.dtype, (end,))[o["begin"] :] for n in ("a", "b", "out"))
        out[:] = semantics.add(a, b)

    def _op_kda_conv(self, p, o, key) -> None:
        B, P = p.batch, p.channels
        q, k, v = (self.buf(o[n], "bfloat16", (B, P)) for n in ("q", "k", "v"))
        state = self.ptr(o["state"])
        yq, yk, yv, new = self._whole(key, lambda: semantics.kda_conv(q, k, v, state.clone(), self.ptr(o["weight_q"]),
                                                                      self.ptr(o["weight_k"]), self.ptr(o["weight_v"])), q, k, v, state)  # fmt: skip
        c0, cc = o["channel_begin"], o["channel_count"]
        for name, y in (("out_q", yq), ("out_k", yk), ("out_v", yv)):
            self.buf(o[name], "bfloat16", (B, P))[:, c0 : c0 + cc] = y[:, c0 : c0 + cc]
        for g in range(3):
            state[:, :, g * P + c0 : g * P + c0 + cc] = new[:, :, g * P + c0 : g * P + c0 + cc]

    def _op_kda_recurrence(self, p, o, key) -> None:
        B, H, D = p.batch, p.num_heads, p.head_dim
        q, k, v = (self.buf(o[n], "bfloat16", (B, H * D)) for n in ("q", "k", "v"))
        g = self.buf(o["g"], "float32", (B, H, D))
        beta = self.buf(o["beta"], "bfloat16", (B, H))
        state = self.ptr(o["state"])
        out, new = self._whole(key, lambda: semantics.kda_recurrence(q, k, v, g, beta, state.clone()), q, k, v, g, beta, state)
        h, v0, vc = o["head"], o["value_begin"], o["value_count"]
        self.buf(o["out"], "bfloat16", (B, H * D))[:, h * D + v0 : h * D + v0 + vc] = out[:, h * D + v0 : h * D + v0 + vc]
        state[:, h, v0 : v0 + vc] = new[:, h, v0 : v0 + vc].to(state.dtype)

    def _op_attn_res(self, p, o, key) -> None:
        sources = [self.buf(o[f"source{i}"], "bfloat16", (p.batch, p.dim)) for i in range(p.num_sources)]
        assert p.num_sources <= MAX_ATTN_RES_SOURCES
        y = self._whole(key, lambda: semantics.attn_res(sources, self.ptr(o["norm_weight"]), self.ptr(o["proj_weight"]), p.eps), *sources)
        b0, bc = o["batch_begin"], o["batch_count"]
        self.buf(o["out"], "bfloat16", (p.batch, p.dim))[b0 : b0 + bc] = y[b0 : b0 + bc]

    def _op_router(self, p, o, key) -> None:
        x = self.buf(o["x"], "bfloat16", (p.batch, p.dim))
        xs = [x, self.ptr(o["norm_weight"])] if p.rmsnorm else [x]
        ids, w = fused.router(xs, self.ptr(o["weight"]), self.ptr(o["bias"]), p.eps if p.rmsnorm else None, p.top_k,
                              p.renormalize, p.scaling)  # fmt: skip
        self.buf(o["ids"], "int32", (p.batch, p.top_k))[:] = ids
        self.buf(o["topk_weights"], "float32", (p.batch, p.top_k))[:] = w

    def _op_router_topk(self, p, o, key) -> None:
        logits = self.buf(o["logits"], "float32", (p.batch, p.num_experts))
        ids, w = semantics.router_topk(logits, self.ptr(o["bias"]), p.top_k, p.renormalize, p.scaling)
        self.buf(o["ids"], "int32", (p.batch, p.top_k))[:] = ids
        self.buf(o["topk_weights"], "float32", (p.batch, p.top_k))[:] = w

    def _op_expert_gated(self, p, o, key) -> None:
        B = p.batch
        x = self.buf(o["x"], "bfloat16", (B, p.in_features))
        slot = o["slot"]
        ids = self.buf(o["ids"], "int32", (B, p.top_k))[:, slot : slot + 1].clone()
        act = SituMul(p.beta, p.linear_beta) if p.activation == "situ" else SiluMul()

        def compute():
            if p.weight_format == "mxfp4":
                return fused.expert_gated_linear_mxfp4(x, self.ptr(o["weight"]), self.ptr(o["scale"]), self.ptr(o["weight_up"]),
                                                       self.ptr(o["scale_up"]), ids, act)  # fmt: skip
            return fused.expert_gated_linear(x, self.ptr(o["weight"]), self.ptr(o["weight_up"]), ids, act)

        y = self._whole(key, compute, x, ids)  # [B, 1, out]
        r0, rc = o["row_begin"], o["row_count"]
        self.buf(o["out"], "bfloat16", (B, p.top_k, p.out_features))[:, slot, r0 : r0 + rc] = y[:, 0, r0 : r0 + rc]

    def _op_expert_combine(self, p, o, key) -> None:
        B = p.batch
        x = self.buf(o["x"], "bfloat16", (B, p.top_k, p.in_features))
        ids = self.buf(o["ids"], "int32", (B, p.top_k))
        w = self.buf(o["topk_weights"], "float32", (B, p.top_k))

        rs = [self.buf(o[n], "bfloat16", (B, p.out_features)) for n in COMBINE_RESIDUAL_OPERANDS[: p.residuals]]

        def compute():
            if p.weight_format == "mxfp4":
                return fused.expert_linear_mxfp4_combine([r.clone() for r in rs], x, self.ptr(o["weight"]), self.ptr(o["scale"]), ids, w)
            return fused.expert_linear_combine([r.clone() for r in rs], x, self.ptr(o["weight"]), ids, w)

        y = self._whole(key, compute, x, ids, w, *rs)
        r0, rc = o["row_begin"], o["row_count"]
        self.buf(o["out"], "bfloat16", (B, p.out_features))[:, r0 : r0 + rc] = y[:, r0 : r0 + rc]

    def _op_mla_latent(self, p, o, key) -> None:
        C = p.kv_lora_rank + p.rope_dim
        x = self.buf(o["x"], "bfloat16", (p.batch, C))
        positions = self.buf(o["positions"], "int32", (p.batch,))
        row = semantics.mla_latent(x, self.ptr(o["norm_weight"]), p.kv_lora_rank, p.eps)
        cache = self.ptr(o["cache"])
        for b in range(o["batch_begin"], o["batch_begin"] + o["batch_count"]):
            t = int(positions[b])
            if 0 <= t < p.max_len:
                cache[b, t] = row[b].to(cache.dtype)

    def _op_mla_q_absorb(self, p, o, key) -> None:
        B, H = p.batch, p.num_heads
        q = self.buf(o["x"], "bfloat16", (B, H * (p.qk_nope + p.qk_rope)))
        y = self._whole(key, lambda: fused.mla_q_absorb(q, self.ptr(o["weight"]), H, p.qk_nope, p.v_dim), q)
        h0, hc, c0 = o["head_begin"], o["head_count"], o["column_begin"]
        c1 = c0 + (p.columns or p.kv_lora_rank)
        c1 = p.kv_lora_rank + p.qk_rope if c1 == p.kv_lora_rank else c1  # the last columns' task copies q_pe
        self.buf(o["out"], "bfloat16", (B, H, p.kv_lora_rank + p.qk_rope))[:, h0 : h0 + hc, c0:c1] = y[:, h0 : h0 + hc, c0:c1]

    def _op_mla_decode(self, p, o, key) -> None:
        B, H, R, K = p.batch, p.num_heads, p.kv_lora_rank, p.num_chunks
        q = self.buf(o["q"], "bfloat16", (B, H, R + p.rope_dim))
        positions = self.buf(o["positions"], "int32", (B,))
        cache = self.ptr(o["cache"])
        oo, lse = self._whole(key, lambda: fused.mla_decode(q, cache, positions.long(), R, K, p.min_chunk_rows, p.scale), q, positions, cache)
        b, c, h0, hc = o["request"], o["chunk"], o["head_begin"], o["head_count"]
        self.buf(o["out"], "float32", (B, K, H, R))[b, c, h0 : h0 + hc] = oo[b, c, h0 : h0 + hc]
        self.buf(o["lse"], "float32", (B, K, H))[b, c, h0 : h0 + hc] = lse[b, c, h0 : h0 + hc]

    def _op_mla_v_up(self, p, o, key) -> None:
        B, H, R, K = p.batch, p.num_heads, p.kv_lora_rank, p.num_chunks
        oo = self.buf(o["o"], "float32", (B, K, H, R))
        lse = self.buf(o["lse"], "float32", (B, K, H))
        y = self._whole(key, lambda: fused.mla_v_up(oo, lse, self.ptr(o["weight"]), H, p.qk_nope, p.v_dim), oo, lse)
        h0, hc, v0, vc = o["head_begin"], o["head_count"], o["value_begin"], o["value_count"]
        out = self.buf(o["out"], "bfloat16", (B, H, p.v_dim))
        out[:, h0 : h0 + hc, v0 : v0 + vc] = y.view(B, H, p.v_dim)[:, h0 : h0 + hc, v0 : v0 + vc]


    # ---- tensor parallelism: rank-local ops, and the collectives' two halves (RankGroup) ---------------
    def _rank(self, o) -> int:
        return int(self.buf(o["rank"], "int32", (1,))[0])

    def _op_shard_slice(self, p, o, key) -> None:
        rank = self.buf(o["rank"], "int32", (1,))
        x = self.buf(o["x"], p.dtype, (p.rows, p.cols))
        self.buf(o["out"], p.dtype, (p.rows, p.cols // p.parts))[:] = collectives.shard_slice(x, rank, 1, p.parts)

    def _op_argmax_partial(self, p, o, key) -> None:
        b0, bc = o["batch_begin"], o["batch_count"]
        value, index = collectives.argmax_partial(self.buf(o["logits"], p.dtype, (p.batch, p.vocab))[b0 : b0 + bc])
        self.buf(o["value"], "float32", (p.batch, 1))[b0 : b0 + bc] = value
        self.buf(o["out"], "int32", (p.batch, 1))[b0 : b0 + bc] = index

    def _op_argmax_combine(self, p, o, key) -> None:
        values = self.buf(o["values"], "float32", (p.batch, p.ranks))
        indices = self.buf(o["indices"], "int32", (p.batch, p.ranks))
        self.buf(o["out"], "int32", (p.batch,))[:] = collectives.argmax_combine(values, indices, p.shard_size)

    def _slot(self, o, p, region: int, source: int) -> torch.Tensor:
        """Slot `source` ([rows, cols]) of this step's parity in the comm region of pointer entry `region`."""
        offset = o["comm_offset"] + (self.epoch & 1) * o["comm_half"] + source * p.slot_bytes
        return self.ptr(region)[offset : offset + p.rows * p.cols * DTYPES[p.dtype].itemsize].view(DTYPES[p.dtype]).view(p.rows, p.cols)

    def _counter(self, o, region: int) -> torch.Tensor:
        return self.ptr(region)[: self.table.comm.events * 8].view(torch.int64)[o["comm_event"] : o["comm_event"] + 1]

    def _push_collective(self, p, o, key) -> None:
        """This rank's columns into its slot of every rank's comm region, then one count on each."""
        c = slice(o["col_begin"], o["col_begin"] + o["col_count"])
        x = self.buf(o["x"], p.dtype, (p.rows, p.cols))
        for q in range(p.ranks):
            self._slot(o, p, o["comm"] + q, self._rank(o))[:, c] = x[:, c]
            self._counter(o, o["comm"] + q).add_(1)

    _push_all_reduce = _push_all_gather = _push_collective

    def _received(self, p, o) -> list[torch.Tensor]:
        """Every rank's columns from this rank's own slots, once every rank pushed this step."""
        own = o["comm"] + self._rank(o)
        count = int(self._counter(o, own))
        if count != p.ranks * self.epoch:
            raise TableExecError(f"comm event {o['comm_event']} holds {count} pushes, step {self.epoch} needs {p.ranks * self.epoch}")
        c = slice(o["col_begin"], o["col_begin"] + o["col_count"])
        return [self._slot(o, p, own, q)[:, c] for q in range(p.ranks)]

    def _op_all_reduce(self, p, o, key) -> None:
        c0, cc = o["col_begin"], o["col_count"]
        self.buf(o["out"], p.dtype, (p.rows, p.cols))[:, c0 : c0 + cc] = collectives.rank_order_sum(self._received(p, o))

    def _op_all_gather(self, p, o, key) -> None:
        c0, cc = o["col_begin"], o["col_count"]
        out = self.buf(o["out"], p.dtype, (p.rows, p.ranks * p.cols))
        for q, piece in enumerate(self._received(p, o)):
            out[:, q * p.cols + c0 : q * p.cols + c0 + cc] = piece


class RankGroup:
    """Every rank of a tensor-parallel table (`table.comm`): one TableExecutor per rank with its pieces of
    the weights and state, each pointer table ending in every rank's comm region as the runtime binds
    them on the GPUs. `step` runs the table on all ranks in lockstep, task by task; a collective task
    first pushes on every rank, then every rank counts its pushes and reduces or assembles."""

    def __init__(self, table: TaskTable, weights: Sequence[Mapping[str, torch.Tensor]], states: Sequence[Mapping[str, torch.Tensor]]):
        if table.comm is None or len(weights) != table.comm.ranks or len(states) != table.comm.ranks:
            raise TableExecError("a RankGroup needs a tensor-parallel table and the weights and states of each of its ranks")
        self.table = table
        self.ranks = [TableExecutor(table, w, st) for w, st in zip(weights, states)]
        for ex in self.ranks:
            ex.pointers += [other.comm for other in self.ranks]

    def step(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """One step on every rank; `inputs` are the step inputs but the rank, which each rank gets its own."""
        for rank, ex in enumerate(self.ranks):
            ex.begin_step({**inputs, collectives.TP_RANK: torch.tensor([rank], dtype=torch.int32)})
        for s, i in self.ranks[0].order:
            if self.table.variants[self.table.lists[s][i].opcode].op in COLLECTIVE_OPS:
                for ex in self.ranks:
                    ex.run_task(s, i, "_push")
            for ex in self.ranks:
                ex.run_task(s, i)


def _operand_names(op: str) -> tuple[str, ...]:
    from k3mk.ir.task_table import OP_KINDS

    return OP_KINDS[op].operands
