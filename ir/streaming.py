"""How a task's weights stream into its CTA's ring of shared-memory slots (docs/megakernel.md, "The
streaming task loop"): the fill geometry that the producer warp and the consumer warps of a task both
follow. Pure Python, like the task table: the codegen renders it into the op templates and the
ring-aware deadlock check (`TaskTable.check_deadlock_free(ring=...)`) counts fills with it, so the
kernel and the check cannot disagree.

A fill is one slot's worth of one task's weights: a row group of `rows` rows x one K chunk, of every
stream of the op (a gemv's weight, the gated gemv's weight and weight_up, an MXFP4 expert's codes and
scales). A row group is adjacent rows of a row-major [out, in] matrix (or of one expert's block of it),
so each stream of a fill is ONE bulk copy of contiguous bytes, except where rows are the A rows of the consumer
warp's m16n8k16 MMAs (`Stream.mma_rows`): an MXFP4 expert's code rows (at most MMA_ROWS over all code streams of a
fill), copied in groups of up to MMA_COPY_ROWS rows placed 64 bytes apart in the banks, and a batched gemv's rows
(ROW_MMA_ROWS over its streams, the requests the MMAs' columns, where its input is staged), cut into chunks and
copied one row per copy, each row 64 bytes apart mod 128 from the next; the diagonal form's batched rows cut into
chunks (CHUNKED_ROWS) are copied one row per copy too. A
task's fills come in a fixed order, in rounds of at most `warps` units that belong to distinct consumer warps,
each round chunk-major (`chunk_major`: chunk c of every unit of the round, then chunk c + 1), so that the few
fills a ring holds are every warp's work, not all the chunks of one or two warps' rows:

  gemv            units = row groups g, warp g % warps; a row-MMA gemv's task of ONE group (FillPlan.row_mma,
                  `split_warps`): chunk c warp c % min(warps, chunks), the partial sums meeting in shared memory
  expert_gated    for u in the task's experts: units = row groups g, warp (u * groups + g) % warps  (rounds within an
                  expert: the producer divides nothing per fill). Grouped (batch > 1, FillPlan.grouped) the task's experts are the step's
                  distinct experts n = slot, slot + top_k, ... (`routing_units`), each applied to every request
                  that chose it: a weight row is read once per step, not once per (request, slot)
  mla_decode      the chunk's KV rows [start, min(end, n - 1)) in blocks of 16 rows, 2 fills of KV_FILL_ROWS each (a
                  fill past those rows brings 0 bytes), every consumer warp reading both fills of a block; the
                  count is 2 per block of the chunk's rows at run time (the step's positions), at most task_fills
  expert_combine  for b in batch: for batches of COMBINE_BATCH_ROWS rows of row groups: for rounds of `warps`
                  slots: for g in the batch: the round's slots j are the units, warp j % warps (expert ids[b, j];
                  its requests and row-group batches run one after another, a barrier between them). Grouped
                  (batch > 1, FillPlan.grouped): the step's (request, slot) pairs sorted by unit (`routing_units`), then request; for
                  batches of row groups: for rounds of `warps` pairs (warp = place in the round): for g in the
                  batch: each unit of the round is ONE fill, which all the round's warps holding its pairs read
                  (their releases add up to one slot's: ring.py.j2 ring_release)

A warp consumes its fills in order and releases each one before it reaches any CTA barrier, except an
mla_decode block's 2 fills, which every warp holds across the block's barriers and releases before it takes
the next block's (so a ring of 2 slots or more always has room for a whole block: check_ring takes a block's
fills together and refuses a 1-slot ring); that, and a producer that waits only for an event complete before
its task's consumers may start (a routed expert's router: every event the task waits on comes after it), is
why the ring cannot deadlock (check_ring executes it; the argument is in TaskTable.check_deadlock_free).

Chunks and sums: a bf16 consumer warp sums a row in spans of LANE_ORDER_ELEMENTS (32 lanes x one 16-byte
vector; a batched gemv's, ROW_MMA_SPAN: 4 lanes x one vector, of 16 rows at once), one pair of m16n8k16 MMAs per
span into the same accumulators, span after span (codegen/templates/bf16_dot.py.j2), so a row's sum does not
depend on how it is cut into chunks: chunks are multiples of the span. (An MXFP4 row too long for a slot is cut into chunks of whole 128-code spans,
MXFP4_CHUNK_ELEMENTS; its MMAs sum a row's spans in order, chunk after chunk.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

SLOT_BYTES = 16 * 1024  # the ring's slot size unless the fills want another (codegen/ops.py fill_slot_bytes)
VECTOR_BYTES = 16  # every copy is a multiple of 16 bytes from a 16-byte aligned address
LANE_ORDER_ELEMENTS = 32 * 8  # bf16: 32 lanes x one 16-byte vector: a span of the consumers' MMAs
MXFP4_CHUNK_ELEMENTS = 32 * 32  # MXFP4 chunks (a row longer than a slot): 32 whole 32-code groups (8 spans)
COMBINE_BATCH_ROWS = 32  # expert_combine: rows whose slot terms wait in smem for the slot-order sum, a batch at a time
ACCUMULATOR_BUDGET = 16  # rows x batch x gated streams of a fill (bf16: 2 fp32 MMA accumulators per lane each, bf16_dot.py.j2)
# A batched gemv's fill: ROW_MMA_ROWS A rows of the consumer warp's m16n8k16 MMAs (16 rows, or 8 rows' gate and
# up), the requests B's columns (8 per MMA): every weight vector a lane loads serves 8 requests, and one x
# vector 16 rows (the diagonal form's 2-row fills at batch 8 read x 4x as often as the weights). A lane loads the
# span's 16-byte vector t = lane % 4 of rows lane // 4 and lane // 4 + 8 (bf16_dot.py.j2).
# A group is one consumer warp's, except in a non-gated task of one group, whose chunks go over min(warps, chunks)
# warps (`FillPlan.split_warps`), their partial C fragments summed in shared memory in warp order after a consumer
# barrier (gemv.py.j2): a one-group task (a router, a narrow projection) left 7 of 8 warps idle, and its bodies took
# 17-22% less time split (at batch 8 too, once the consumers hold 192 registers: KernelConfig.for_batch). Splitting every task's groups over the warps (rounds of
# n groups, 8 // n warps each, one barrier per round) was slower: a task of 2+ groups gets its fills no faster than one
# warp per group takes them, and the barrier and shared-memory epilogue cost more than the faster sums saved
# (BENCHMARKS.md, 2026-12-04 evening). Only from ROW_MMA_MIN_BATCH requests and where the input is staged in shared
# memory in every kernel (`gemv_stages_x`); elsewhere the batched gemv keeps the diagonal form's CHUNKED_ROWS fills.
# Measured with one warp per group: reading x from the arena, a row MMA waits on L2 for every span (bench_chain4_b4
# 780 vs 344 us, bench_gemv_b8 152 vs 124 us); at batch 2 the grid was 3-7% slower.
ROW_MMA_ROWS = 16
ROW_MMA_MIN_BATCH = 4
ROW_MMA_SPAN = 4 * 8
CHUNKED_ROWS = 4  # rows of a batched gemv's chunked fill in the diagonal form: its copies per stream (fill_plan)
X_STAGE_BYTES = 64 * 1024  # a gemv stages an input it could read from the arena up to this (codegen/ops.py x_staging_limit)
# The most a gemv stages in shared memory beside the ring: its whole (normalised) input, batch x in_features bf16. An
# rmsnorm prologue needs that copy, so passes/fuse_norm.py fuses a norm only into readers whose input fits.
X_SMEM_BUDGET = 160 * 1024
# MXFP4 expert fills: the code rows of all streams are A rows 0..7 of the consumer's m16n8k16 MMAs (A rows 8..15
# hold the same rows' other code pairs, codegen/templates/mxfp4_dot.py.j2), MMA row g reading code row mma_code_row
MMA_ROWS = 8
# ... copied MMA_COPY_ROWS rows per bulk copy, the copies 64 bytes apart mod 128 (FillPlan.group_pitch). A lane's
# 16-byte loads go 8 lanes (MMA rows 2q, 2q + 1) per shared-memory wavefront: mma_code_row puts those two rows
# in different copies (gate and up, or rows q and 4 + q), 64 bytes apart in the banks, so the loads are
# conflict-free. One copy per row (10 copies per fill instead of 4) kept the producer busy and was 1.8% slower
# on the K3 proxy (BENCHMARKS.md, 2026-12-02).
MMA_COPY_ROWS = 4
# codes of a row per MMA span: each of 4 lanes loads one 32-code group (16 bytes) and the span's 4 MMAs take a
# word of each (mxfp4_dot.py.j2); the staged x is padded to whole spans (zeros past in_features)
MXFP4_SPAN = 4 * 32
assert MXFP4_CHUNK_ELEMENTS % MXFP4_SPAN == 0  # a chunk is whole spans (the templates index spans across chunks)
STREAMING_OPS = ("gemv", "expert_gated", "expert_combine", "mla_decode")
# An mla_decode task streams its chunk's KV cache rows (not weights: the step's cache, rows earlier steps wrote) in fills of
# KV_FILL_ROWS rows, each row one bulk copy at a padded pitch (its score and value fragment loads bank-conflict free); a
# block of 2 fills (16 rows: the two n-tiles of its score MMAs) is read by every consumer warp at once (FillPlan.held).
# The row this step writes (position n - 1, mla_latent's) is never a fill's: the consumers load it after their wait.
KV_FILL_ROWS = 8
# Ops whose producer waits before issuing, on the task's weight wait only (the experts' rows are known
# once the router has written the ids: passes/build_events.py "weight waits"); every other op's producer
# never waits on an event.
PRODUCER_WAITS = frozenset({"expert_gated", "expert_combine"})
# The routed experts are grouped by expert (FillPlan.grouped) where independent requests would leave at most this share
# of the (request, slot) pairs on distinct experts: 64 experts / top-16 at batch 4 (the K3 proxies) 0.68, grouped;
# 256 / top-8 (Kimi Linear) 0.95 and K3's 896 / top-16 0.97 at batch 4, not (their shared bytes would not pay for the
# tables); K3 at batch 16, 0.88.
GROUPING_DISTINCT = 0.9


class StreamingError(ValueError):
    """An op shape the ring cannot stream (a fill that does not fit a slot, a misaligned copy)."""


def mma_code_row(code_streams: int, copy_rows: int, g: int) -> tuple[int, int]:
    """(code stream, row of the fill) that MMA row g (lane // 4) of an MXFP4 consumer warp reads: with gate and up
    streams, gate row g // 2 (even g) or up row g // 2 (odd g); with one stream, row g // 2 (even g) or copy_rows
    + g // 2 (odd g: the next copy). A row past the fill's rows re-reads its last row (not stored). The expert
    templates render this formula; the CPU tests check the load geometry and the MMAs with it."""
    if code_streams == 2:
        return g % 2, g // 2
    return 0, (g % 2) * copy_rows + g // 2


def chunk_major(units: int, warps: int, chunks: int) -> list[tuple[int, int]]:
    """(unit, chunk) of each fill in issue order: units u, u + 1, ... belong to warps in turn (u % warps), so a
    round of `warps` units has one per warp; within a round chunk c of every unit comes before chunk c + 1. A warp
    still takes its fills in order (its units lie in different rounds). Unit-major order instead (all the chunks
    of a unit, then the next unit) left a 10-slot ring holding 2-3 warps' fills when rows are cut into 4 chunks.
    The templates render this order: fill (u, c) = (first unit of u's round) * chunks + c * (units in the
    round) + u % warps."""
    return [(u, c) for r0 in range(0, units, warps) for c in range(chunks) for u in range(r0, min(r0 + warps, units))]


def mxfp4_padded(in_features: int) -> int:
    """Elements of a staged MXFP4 expert input: in_features rounded up to whole spans (MXFP4_SPAN)."""
    return -(-in_features // MXFP4_SPAN) * MXFP4_SPAN


@dataclass(frozen=True)
class Stream:
    """One weight tensor of a fill. `num / den` bytes per element: bf16 2/1, E2M1 codes 1/2, UE8M0
    scales (one per 32 elements) 1/32. A `window` stream's rows are not whole 16-byte vectors (MXFP4
    scales of in_features not a multiple of 512): a fill copies the 16-byte aligned window around its
    rows, which starts (row0 * row bytes) % 16 bytes before them (one expert's block of rows is a
    multiple of 16 bytes: fill_plan checks it)."""

    operand: str  # the task operand holding its weight id
    num: int
    den: int
    window: bool = False
    # MXFP4 codes: rows that are MMA A rows, copied MMA_COPY_ROWS at a time (FillPlan.row_offset)
    mma_rows: bool = False

    def bytes(self, elements: int) -> int:
        return elements * self.num // self.den


@dataclass(frozen=True)
class FillPlan:
    """The fill geometry of one op variant (module docstring)."""

    op: str
    in_features: int  # K: elements of one full row
    out_features: int  # rows of one expert (the experts' row stride); the gemv's own rows otherwise
    rows: int  # rows per fill (1 when a row is cut into chunks, except a batched gemv's chunked groups: fill_plan)
    chunk: int  # elements per chunk (in_features when chunks == 1)
    chunks: int
    streams: tuple[Stream, ...]
    batch: int
    top_k: int = 1
    num_experts: int = 0  # the routed experts'
    row_mma: bool = False  # a batched gemv whose rows are the MMAs' A rows, the requests their columns (ROW_MMA_ROWS)
    split: bool = False  # a row-MMA gemv whose one-group tasks spread their chunks over the warps (gemv_row_mma_split)
    kv_rows: bool = False  # mla_decode's KV cache rows (`_kv_fill_plan`): out_features = a chunk's most rows
    pitch: int = 0  # slot bytes from one row to the next where rows are padded (kv_rows); 0 = packed

    @property
    def held(self) -> int:
        """Fills a consumer warp holds at once: a KV block's 2 (every warp reads both), else 1."""
        return 2 if self.kv_rows else 1

    def chunk_elements(self, c: int) -> int:
        return min(self.chunk, self.in_features - c * self.chunk)

    @property
    def copy_rows(self) -> int:
        """Rows per bulk copy of an mma_rows stream: a batched gemv's rows of a chunk are not adjacent."""
        return 1 if self.row_mma else min(self.rows, MMA_COPY_ROWS)

    def copy_groups(self) -> int:
        return -(-self.rows // self.copy_rows)

    def group_pitch(self, st: Stream) -> int:
        """Slot bytes from one copy of an mma_rows stream to the next: its rows, padded to 64 mod 128 bytes so
        that consecutive copies (of one stream or the next) fall 16 banks apart."""
        return _row_pitch(self.copy_rows * st.bytes(self.chunk))

    def row_offset(self, st: Stream, r: int) -> int:
        """Byte offset of row r of mma_rows stream `st` within the stream (the templates render this formula)."""
        return (r // self.copy_rows) * self.group_pitch(st) + (r % self.copy_rows) * st.bytes(self.chunk)

    def stream_bytes(self, st: Stream) -> int:
        """Slot bytes of stream `st`: its row group, or for a window stream the largest window."""
        if st.mma_rows:
            return self.copy_groups() * self.group_pitch(st)
        if self.pitch:
            return self.rows * self.pitch
        need = self.rows * st.bytes(self.chunk)
        return -(-need // VECTOR_BYTES) * VECTOR_BYTES + VECTOR_BYTES if st.window else need

    def stream_offset(self, s: int) -> int:
        """Byte offset of stream s in a slot: the streams' row groups one after another."""
        return sum(self.stream_bytes(st) for st in self.streams[:s])

    def fill_bytes(self, valid_rows: int, c: int) -> int:
        """Bytes the non-window streams of a fill of `valid_rows` rows (the last group may be short) x
        chunk c bring (a window stream adds its window's length, known at run time)."""
        return sum(valid_rows * st.bytes(self.chunk_elements(c)) for st in self.streams if not st.window)

    @property
    def slot_need(self) -> int:
        return sum(self.stream_bytes(st) for st in self.streams)

    def groups(self, row_count: int) -> int:
        return -(-row_count // self.rows)

    @property
    def grouped(self) -> bool:
        """Whether a task streams each of the step's distinct experts (`routing_units`) once for all the requests that
        chose it: the routed experts at batch > 1 with whole rows per fill, where requests routed independently would
        share experts (`expected_distinct_experts` at most GROUPING_DISTINCT of the (request, slot) pairs). A row cut into
        chunks would need each request's partial sums kept across the chunks (registers per request): there every
        (request, slot) streams its own expert's rows, as at batch 1. Grouping costs each task its expert table (a
        warp's shuffles, ~2 us) and pays back only the bytes of shared experts: with every pair's expert distinct it
        was 1.9-2.8% slower on the K3 proxies at batch 4 (BENCHMARKS.md, 2026-12-03 late night)."""
        if self.op not in ("expert_gated", "expert_combine") or self.batch == 1 or self.chunks > 1:
            return False
        return expected_distinct_experts(self.num_experts, self.top_k, self.batch) <= GROUPING_DISTINCT * self.batch * self.top_k

    @property
    def batch_groups(self) -> int:
        """expert_combine: row groups per batch, whose terms wait in smem for the slot-order sum: COMBINE_BATCH_ROWS
        rows per request's slots, or grouped, the terms of all requests' slots: 4 requests' worth (8 KB at top-16)."""
        rows = COMBINE_BATCH_ROWS * 4 // self.batch if self.grouped else COMBINE_BATCH_ROWS
        return max(1, rows // self.rows)

    def task_fills(self, row_count: int) -> int:
        """Fills of a task of `row_count` rows, in every request (and routing slot) it covers: a grouped task
        (`grouped`) issues at most these, as many as the step's routing gives it; an mla_decode task at most 2 per 16-row block
        of its chunk's most rows, as many as the step's positions give it (2 per block of its chunk's rows)."""
        if self.kv_rows:
            return 2 * -(-self.out_features // (2 * self.rows))
        reps = self.batch * (self.top_k if self.op == "expert_combine" else 1) if self.op != "gemv" else 1
        return reps * self.groups(row_count) * self.chunks

    def split_warps(self, warps: int) -> int:
        """Consumer warps over which a row-MMA gemv's task of ONE group spreads its chunks (module docstring): warp w
        takes chunks w, w + this, ...; 1 (one warp per group) where `gemv_row_mma_split` says no."""
        return min(warps, self.chunks) if self.split else 1

    def owners(self, row_count: int, warps: int) -> list[int]:
        """The consumer warp of each fill of a task, in issue order (module docstring; a grouped task's: with every
        pair's expert distinct)."""
        if self.kv_rows:
            raise ValueError("an mla_decode fill is read by every consumer warp (FillPlan.held), not one")
        groups = self.groups(row_count)
        if self.row_mma and groups == 1:
            return [c % self.split_warps(warps) for c in range(self.chunks)]
        if self.op == "gemv":
            return [g % warps for g, _ in chunk_major(groups, warps, self.chunks)]
        if self.op == "expert_gated":
            return [(u * groups + g) % warps for u in range(self.batch) for g, _ in chunk_major(groups, warps, self.chunks)]
        batch_groups = self.batch_groups
        out = []
        if self.grouped:  # at most: every pair its own expert (the step's routing decides)
            pairs = self.batch * self.top_k
            for g0 in range(0, groups, batch_groups):
                for r0 in range(0, pairs, warps):
                    out += [k % warps for _ in range(min(batch_groups, groups - g0)) for k in range(r0, min(r0 + warps, pairs))]
            return out
        for _ in range(self.batch):
            for g0 in range(0, groups, batch_groups):
                for j0 in range(0, self.top_k, warps):
                    for _ in range(min(batch_groups, groups - g0)):
                        out += [j % warps for j, _ in chunk_major(min(warps, self.top_k - j0), warps, self.chunks)]
        return out


def _bf16(operand: str) -> Stream:
    return Stream(operand, 2, 1)


def _mxfp4(codes: tuple[str, ...], scales: tuple[str, ...], in_features: int) -> tuple[Stream, ...]:
    """The code streams first (their rows are the MMA's A rows, one pitch apart across streams), then the scales."""
    window = (in_features // 32) % VECTOR_BYTES != 0
    return tuple(Stream(c, 1, 2, mma_rows=True) for c in codes) + tuple(Stream(sc, 1, 32, window=window) for sc in scales)


def _chunking(k: int, bytes_per_element: float, room: int, lane_order: int, what: str) -> tuple[int, int]:
    """(chunk, chunks): the fewest equal chunks of a row (multiples of the lane order) whose elements, at
    `bytes_per_element` over the fill's rows and streams, fit `room` bytes."""
    fit = int(room // bytes_per_element) // lane_order * lane_order
    if fit < lane_order:
        raise StreamingError(f"{what}: a {room}-byte slot holds no chunk of {lane_order} elements")
    chunks = -(-k // fit)
    chunk = -(-k // (chunks * lane_order)) * lane_order
    return chunk, -(-k // chunk)


def _row_pitch(row_bytes: int) -> int:
    """Slot bytes from one row of a batched gemv's fill to the next: 64 mod 128, so that the 8 lanes of a wavefront
    (rows 2q and 2q + 1, 4 vectors each) load 8 distinct 16-byte bank groups (FillPlan.group_pitch)."""
    return row_bytes + (64 - row_bytes) % 128


def _row_mma_chunking(k: int, rows: int, slot_bytes: int, what: str) -> tuple[int, int]:
    """(chunk, chunks) of a batched gemv: the fewest equal chunks of whole spans (ROW_MMA_SPAN; a chunk of a
    shorter row is the row) whose `rows` rows, at their pitch, fit a slot."""
    for chunks in range(1, -(-k // ROW_MMA_SPAN) + 1):
        chunk = min(k, -(-k // (chunks * ROW_MMA_SPAN)) * ROW_MMA_SPAN)
        if rows * _row_pitch(chunk * 2) <= slot_bytes:
            return chunk, -(-k // chunk)
    raise StreamingError(f"{what}: a {slot_bytes}-byte slot holds no {rows} rows of {ROW_MMA_SPAN} elements")


def gemv_stages_x(params: Any) -> bool:
    """Whether a gemv's input is in shared memory in every kernel: its rmsnorm prologue needs the copy, gated_rmsnorm
    keeps one up to X_SMEM_BUDGET, or it fits X_STAGE_BYTES (codegen/ops.py gemv_x_in_smem)."""
    need = params.batch * params.in_features * 2
    return params.rmsnorm or (params.epilogue == "gated_rmsnorm" and need <= X_SMEM_BUDGET) or need <= X_STAGE_BYTES


def gemv_row_mma(params: Any) -> bool:
    """Whether a gemv runs on row MMAs (ROW_MMA_ROWS): from ROW_MMA_MIN_BATCH requests, its input staged."""
    return params.batch >= ROW_MMA_MIN_BATCH and gemv_stages_x(params)


def gemv_gated(params: Any) -> bool:
    """A gated gemv (fused.gated_linear): weight (gate) and weight_up, streamed together."""
    return params.epilogue in ("silu_mul", "situ_mul")


def gemv_row_mma_split(params: Any) -> bool:
    """Whether a row-MMA gemv's task of one group may spread its chunks over the warps (FillPlan.split_warps): not
    gated (a second copy of the gated epilogues spilled)."""
    return gemv_row_mma(params) and not gemv_gated(params)


def fill_plan(op: str, params: Any, slot_bytes: int = SLOT_BYTES) -> FillPlan | None:
    """The fill geometry of a variant, or None when the op does not stream its weights (it reads global
    memory in its body: every op but the weight GEMVs and the routed experts)."""
    if op not in STREAMING_OPS:
        return None
    if op == "mla_decode":
        return _kv_fill_plan(params, slot_bytes)
    k, batch = params.in_features, params.batch
    if op == "gemv":
        gated = gemv_gated(params)
        streams = (_bf16("weight"), _bf16("weight_up")) if gated else (_bf16("weight"),)
        accumulators_per_row = batch * len(streams)
        lane_order, top_k = LANE_ORDER_ELEMENTS, 1
    else:
        gated = op == "expert_gated"
        if params.weight_format == "mxfp4":
            streams = _mxfp4(("weight", "weight_up"), ("scale", "scale_up"), k) if gated else _mxfp4(("weight",), ("scale",), k)
            lane_order = MXFP4_CHUNK_ELEMENTS
        else:
            streams = (_bf16("weight"), _bf16("weight_up")) if gated else (_bf16("weight"),)
            lane_order = LANE_ORDER_ELEMENTS
        accumulators_per_row = 2 if gated else 1  # per request of a pass (MXFP4: rows are MMA rows, the requests columns)
        top_k = params.top_k
    row_bytes = sum(st.bytes(k) for st in streams)
    windows = [st for st in streams if st.window]
    if windows and (params.out_features * windows[0].bytes(k)) % VECTOR_BYTES:
        raise StreamingError(f"{op}: an expert's MXFP4 scales ({params.out_features} rows x {windows[0].bytes(k)} B) are not a "
                             f"multiple of {VECTOR_BYTES} bytes, which the ring's bulk copies need")  # fmt: skip
    code_streams = sum(st.mma_rows for st in streams)
    max_rows = MMA_ROWS // code_streams if code_streams else max(1, ACCUMULATOR_BUDGET // accumulators_per_row)
    # a window stream's alignment and rounding; the padding of an mma_rows stream's copies (at most 127 B each)
    slack = 2 * VECTOR_BYTES * len(windows) + (128 * (MMA_ROWS // MMA_COPY_ROWS) if code_streams else 0)
    if row_bytes + slack <= slot_bytes:
        rows, chunk, chunks = min(max_rows, (slot_bytes - slack) // row_bytes), k, 1
    elif windows:
        raise StreamingError(f"{op}: an MXFP4 row of {k} elements ({row_bytes} B with its scales) does not fit a {slot_bytes}-byte slot")
    else:
        rows, chunk, chunks = 1, *_chunking(k, row_bytes / k, slot_bytes - slack, lane_order, f"{op} ({len(streams)} stream(s))")
    row_mma = op == "gemv" and gemv_row_mma(params)
    if row_mma:
        streams = tuple(Stream(st.operand, 2, 1, mma_rows=True) for st in streams)
        rows, chunk, chunks = ROW_MMA_ROWS // len(streams), *_row_mma_chunking(k, ROW_MMA_ROWS, slot_bytes, op)
    elif op == "gemv" and batch > 1 and rows < min(max_rows, CHUNKED_ROWS):
        # A batched gemv whose slot holds few whole rows: cut CHUNKED_ROWS rows into chunks instead (one copy
        # per row and chunk), so each x vector a lane loads and unpacks serves more rows; taken when a fill
        # carries no fewer bytes. Measured (BENCHMARKS.md, 2026-12-02 late evening): -10% where x is read from
        # the arena (wide inputs), +1% on a GEMV whose x is staged; K3 proxy b4 -4.8%.
        more = min(max_rows, CHUNKED_ROWS)
        if more * lane_order * row_bytes // k <= slot_bytes - slack:
            more_chunk, more_chunks = _chunking(k, row_bytes / k * more, slot_bytes - slack, lane_order, f"{op} ({more} rows)")
            if more * more_chunk >= rows * chunk:
                rows, chunk, chunks = more, more_chunk, more_chunks
    plan = FillPlan(op, k, params.out_features, rows, chunk, chunks, streams, batch, top_k, getattr(params, "num_experts", 0), row_mma,
                    row_mma and gemv_row_mma_split(params))
    for st in streams:
        for c in range(chunks):
            if not st.window and (st.bytes(plan.chunk_elements(c)) % VECTOR_BYTES or st.bytes(k) % VECTOR_BYTES):
                raise StreamingError(f"{op} stream {st.operand!r}: a row of {k} elements gives copies that are not multiples of {VECTOR_BYTES} bytes")
    assert plan.slot_need <= slot_bytes
    return plan


def kv_chunk_max_rows(params: Any) -> int:
    """The most KV rows an mla_decode chunk holds: max(ceil(max_len / num_chunks), min_chunk_rows) (ir/fused.py
    kv_chunk_bounds at n = max_len)."""
    return max(-(-params.max_len // params.num_chunks), params.min_chunk_rows)


def _kv_fill_plan(params: Any, slot_bytes: int) -> FillPlan:
    """mla_decode: fills of KV_FILL_ROWS cache rows (kv_lora_rank + rope bf16 each) at a pitch of 8 more elements."""
    c = params.kv_lora_rank + params.rope_dim
    pitch = (c + 8) * 2
    if KV_FILL_ROWS * pitch > slot_bytes:
        raise StreamingError(f"mla_decode: {KV_FILL_ROWS} KV rows of {c} elements ({KV_FILL_ROWS * pitch} B padded) do not fit a {slot_bytes}-byte slot")
    if (c * 2) % VECTOR_BYTES or pitch % VECTOR_BYTES:
        raise StreamingError(f"mla_decode: a KV row of {c} elements is not a multiple of {VECTOR_BYTES} bytes, which the bulk copies need")
    return FillPlan("mla_decode", c, kv_chunk_max_rows(params), KV_FILL_ROWS, c, 1, (_bf16("cache"),), params.batch,
                    kv_rows=True, pitch=pitch)  # fmt: skip


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """E * (1 - (1 - k/E)^B): experts touched by B tokens choosing k of E uniformly (spec 11). Real routers favour some
    experts: more are shared. (The roofline's expected routing, passes/schedule.py, and the grouping's condition.)"""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def routing_units(ids: list[list[int]]) -> list[tuple[int, dict[int, int]]]:
    """The step's distinct experts in the order a grouped expert_gated (FillPlan.grouped) numbers them, from the
    router's ids [batch][top_k]: (expert, {request: slot}) per distinct expert, in the order of each expert's first
    routing pair p = request * top_k + slot. Unit n belongs to the task of slot n % top_k, as its unit n // top_k,
    so every task holds ceil or floor(units / top_k) of them whatever the routing (no straggler SM when all
    requests choose the same experts). The templates compute this in one warp (expert_units.py.j2); this is its
    model for the tests and the replay."""
    units: dict[int, dict[int, int]] = {}
    for b, row in enumerate(ids):
        for j, e in enumerate(row):
            units.setdefault(e, {})[b] = j
    return list(units.items())


def combine_rounds(ids: list[list[int]], warps: int) -> list[list[int]]:
    """A grouped expert_combine's rounds: the (request, slot) pairs sorted by unit (`routing_units`) then request, `warps`
    at a time (warp = place in the round), as the experts of each round, one fill per expert and row group."""
    pairs = [e for e, slots in routing_units(ids) for _ in slots]
    return [sorted(set(pairs[r : r + warps]), key=pairs.index) for r in range(0, len(pairs), warps)]


def task_units(ids: list[list[int]], slot: int) -> list[tuple[int, dict[int, int]]]:
    """The units of the grouped expert_gated task of routing slot `slot` (`routing_units`)."""
    top_k = len(ids[0])
    return routing_units(ids)[slot::top_k]


def producer_waits(op: str) -> bool:
    """Whether the producer waits on an event (the task's weight wait) before issuing its fills (the routed experts)."""
    return op in PRODUCER_WAITS



@dataclass(frozen=True)
class RingModel:
    """What the ring-aware deadlock check needs to know of a kernel: its ring (codegen/ops.py RingLayout)."""

    slots: int
    records: int
    warps: int
    slot_bytes: int = SLOT_BYTES


def check_ring(table: Any, ring: RingModel, rng: Any = None) -> None:
    """Execute one step of `table` abstractly with the streaming loop's processes: per CTA a producer
    (forwards record i once its consumers finished task i - records; for a routed expert, waits on the
    task's weight wait, the router's event; issues the task's fills, fill f once fill f - slots was released) and its consumers
    (take record j once forwarded, wait on the task's events, consume the task's fills as they land,
    signal). Raises ValueError naming the stuck producers and consumers if some task never runs.

    Every enabling condition only ever becomes true (counters grow), so the set of actions that can run
    is the same in every execution: if this one (greedy, or in the random interleaving `rng` picks)
    completes, none deadlocks. The consumers are modelled as one process taking the task's fills in
    order; the real warps take their own fills in order and release each before any CTA barrier, so a
    fill the producer waits for is always held by a warp that can finish it (ir/streaming.py docstring).
    The kernel's waiter and signaller warps (megakernel.py.j2) do the consumers' event waits and signals; the
    model keeps both in the consumers' process, which is sound because the waiter makes the model's waits in
    list order (only earlier) and the signaller waits for nothing but the consumers' `done`: as in the model,
    a task's signal never waits on a later task's events."""
    counts = table.event_counts()
    seen = [0] * len(table.events)
    plans = [fill_plan(v.op, v.params, ring.slot_bytes) for v in table.variants]
    lists = table.lists
    n = len(lists)
    if ring.slots < 1 or ring.records < 1:
        raise ValueError(f"a ring needs slots and records, got {ring}")
    holder = max((p for p in plans if p), key=lambda p: p.held, default=None)
    if holder is not None and holder.held > ring.slots:
        raise ValueError(f"deadlock in the streaming loop ({ring.slots} ring slots, {ring.records} records): every {holder.op} "
                         f"task holds {holder.held} fills at once")  # fmt: skip

    def fills(t) -> int:
        plan = plans[t.opcode]
        return plan.task_fills(t.operands.get("row_count", 0)) if plan else 0

    def held(t) -> int:
        plan = plans[t.opcode]
        return plan.held if plan else 1

    def missing(events) -> int | None:
        return next((e for e in events if seen[e] < counts[e]), None)

    p_task, p_fills, p_within, forwarded, p_waited = [0] * n, [0] * n, [0] * n, [0] * n, [False] * n
    c_task, c_fills, c_within, started = [0] * n, [0] * n, [0] * n, [False] * n
    blocked: dict[int, list[tuple[int, str]]] = {}
    ready: deque = deque((s, role) for s in range(n) for role in ("producer", "consumer"))
    queued = set(ready)

    def wake(proc):
        if proc not in queued:
            queued.add(proc)
            ready.append(proc)

    def run_producer(s: int, budget: int) -> bool:
        moved = False
        while p_task[s] < len(lists[s]) and budget > 0:
            i, t = p_task[s], lists[s][p_task[s]]
            if forwarded[s] == i:
                if i - ring.records >= c_task[s]:
                    break  # the record slot is still the consumers' (task i - records)
                forwarded[s], moved, budget = i + 1, True, budget - 1
            if t.weight_wait is not None and not p_waited[s]:
                e = missing((t.weight_wait,))
                if e is not None:
                    blocked.setdefault(e, []).append((s, "producer"))
                    break
                p_waited[s] = True
            total = fills(t)
            issue = min(total - p_within[s], c_fills[s] + ring.slots - p_fills[s])
            if issue > 0:
                p_fills[s] += issue
                p_within[s] += issue
                moved, budget = True, budget - 1
            if p_within[s] < total:
                break  # every slot holds a fill its consumers have not released
            p_task[s], p_within[s], p_waited[s] = i + 1, 0, False
        return moved

    def run_consumer(s: int, budget: int) -> bool:
        moved = False
        while c_task[s] < len(lists[s]) and budget > 0:
            j, t = c_task[s], lists[s][c_task[s]]
            if not started[s]:
                if forwarded[s] <= j:
                    break
                e = missing(t.wait)
                if e is not None:
                    blocked.setdefault(e, []).append((s, "consumer"))
                    break
                started[s] = True
            total = fills(t)
            take = min(total - c_within[s], p_fills[s] - c_fills[s])
            take -= take % held(t)  # an mla_decode block's fills are taken together
            if take > 0:
                c_fills[s] += take
                c_within[s] += take
                moved, budget = True, budget - 1
            if c_within[s] < total:
                break
            if t.signal is not None:
                seen[t.signal] += 1
                if seen[t.signal] == counts[t.signal]:
                    for proc in blocked.pop(t.signal, []):
                        wake(proc)
            c_task[s], c_within[s], started[s] = j + 1, 0, False
            moved, budget = True, budget - 1
        return moved

    while ready:
        if rng is None:
            proc = ready.popleft()
        else:
            k = rng.randrange(len(ready))
            ready.rotate(-k)
            proc = ready.popleft()
        queued.discard(proc)
        s, role = proc
        budget = 1 << 62 if rng is None else rng.randint(1, 3)
        moved = (run_producer if role == "producer" else run_consumer)(s, budget)
        if moved:
            wake((s, "consumer" if role == "producer" else "producer"))
            if rng is not None:
                wake(proc)  # a bounded run may have stopped short: look again
    stuck = [s for s in range(n) if c_task[s] < len(lists[s])]
    if stuck:
        lines = [f"deadlock in the streaming loop ({ring.slots} ring slots, {ring.records} records): {len(stuck)} CTAs stuck"]
        for s in stuck[:6]:
            lines.append(f"  CTA {s}: producer {_where(table, s, p_task[s], seen, counts)}; "
                         f"consumers {_where(table, s, c_task[s], seen, counts)}")  # fmt: skip
        raise ValueError("\n".join(lines))


def _where(table: Any, s: int, i: int, seen: list[int], counts: list[int]) -> str:
    tasks = table.lists[s]
    if i >= len(tasks):
        return "done"
    t = tasks[i]
    def name(events) -> str:
        return ", ".join(f"event {e} ({table.events[e].name}: {seen[e]}/{counts[e]})" for e in events) or "no events"

    weights = "" if t.weight_wait is None else f"; its weights wait on {name((t.weight_wait,))}"
    return f"at task {i} ({t.label or table.variants[t.opcode].op}; waits on {name(t.wait)}{weights})"
