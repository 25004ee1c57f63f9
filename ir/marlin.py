"""vLLM's Marlin W4A16 MXFP4 layout of the routed experts (what vLLM binds on Hopper), and how a GPU lane
reads it. Pure torch: the layout's definition, its inverse, a dequantisation read from it, and a bit-level
emulation of the decode a consumer warp will run. docs/engine_contract.md, section 2 "vLLM on Hopper (sm_90):
the Marlin W4A16 MXFP4 repack" (what vLLM does) and section 8 (what is pinned where).

One expert's weight is B[k, n] of mma.m16n8k16 (k = the reduction, in_features, K of them; n = out_features,
N of them; activations are A). The checkpoint (compressed-tensors) holds it as packed uint8 [N, K/2] (the
even k in the low nibble) and scales uint8 [N, K/32] (UE8M0: 2^(s-127) per 32 inputs).

Weights, qweight int32 [K/16, 2N] per expert (`ops.gptq_marlin_repack`'s output; its Python reference is
`marlin_weights` + `get_weight_perm(4)`). Row kt holds k = 16kt..16kt+15. The row is cut into 16x64 tiles,
tile T (n = 64T..64T+63) in words 128T..128T+127. Lane l = 4g + t of a warp (g = groupID, t =
threadID_in_group) owns the 16-byte vector of words 4l..4l+3; its word j covers the 16-column sub-tile j,
and nibble q = 4x + 2b + h (bits 4q..4q+3) of it holds

    k = 2t + 8h + x,  n = 16j + 8b + g          (x, b, h in {0, 1})

so nibbles (i, i+4), i = 2b + h, are register h of the bf16 B fragment of n8 block 2j + b: b0,b1 (h = 0,
k = 2t, 2t+1) or b2,b3 (h = 1, k = 2t+8, 2t+9), n = groupID. vLLM's nibble interleave [0,2,4,6,1,3,5,7]
is what puts a register's two k in nibbles four apart.

Scales, qscale [K/32, N] per expert (e8m0 bytes; vLLM's dtype float8_e8m0fnu). Row = one 32-group of k; its
64-byte chunk T holds tile T's columns, byte c of it the column c//8 + 8*MARLIN_SCALE_BLOCK[c%8] (the 8x8
transpose of `get_scale_perms`' scale_perm, then `mxfp4_marlin_process_scales`' [0,2,1,3] within 4 bytes).
So the scales of an mma accumulator's columns are adjacent: a lane's C fragment covers columns 2t, 2t+1 of
every n8 block, and those 16 scales are bytes 16t..16t+15 of the chunk (one 16-byte load per group and
tile, `marlin_lane_scales`). For scaling B instead, groupID g's 8 columns g + 8m are bytes 8g..8g+7.

Decode (`decode_e2m1_pair_bf16x2`): an E2M1 code's sign goes to bf16 bit 15 and its 3 magnitude bits
(2 exponent, 1 mantissa) to bits 8..6, the low end of bf16's exponent field and the top of its mantissa.
The bits then read as the bf16 E2M1 x 2^-126 (bf16's exponent bias 127 against E2M1's 1; the code 0.5
becomes the bf16 subnormal 2^-127, which is why the GPU multiply must keep subnormals), and one exact
bf16x2 multiply by 2^126 (DECODE_P) gives the value. Scaling (`e8m0_to_f32_bits`): the fp32 partial of a
32-group is multiplied by 2^(s-127), an fp32 built by shifting s into the exponent field.
"""

from __future__ import annotations

import functools

import torch

from k3mk.ir.semantics import E2M1_VALUES

TILE_K = 16  # k-rows of a Marlin tile (one mma k16 step)
TILE_N = 64  # columns of a Marlin tile: 4 sub-tiles of 16, 8 n8 blocks
GROUP = 32  # inputs per UE8M0 scale
# Marlin tiles need N % 64 and K % 16, the groups K % 32; K % 64 as vLLM's NVFP4 MoE Marlin path asserts of the
# hidden size (its MXFP4 path checks nothing), which also keeps K = 32, where marlin_permute_scales takes its
# channelwise permutation instead, out.
ALIGN_N = TILE_N
ALIGN_K = 64

MARLIN_SCALE_BLOCK = (0, 2, 1, 3, 4, 6, 5, 7)  # n8 block of byte m of a column's 8 scale bytes
DECODE_P = 126  # decode_e2m1_pair_bf16x2's bits read as E2M1 x 2^-126; the multiply by 2^126 restores it
_BF16_2P = torch.tensor(2.0**DECODE_P, dtype=torch.bfloat16)
_I32 = torch.int32


def marlin_lane_elements(lane: int) -> list[tuple[int, int, int, int]]:
    """(word, nibble, k, n) of the 32 codes lane `lane` reads in one 16x64 tile: word 0..3 of its 16-byte
    vector (words 4*lane.. of the tile), nibble 0..7 (bits 4*nibble..), k 0..15, n 0..63 within the tile."""
    if not 0 <= lane < 32:
        raise ValueError(f"lane: expected 0..31, found {lane}")
    g, t = divmod(lane, 4)
    out = []
    for j in range(4):
        for q in range(8):
            x, b, h = q // 4, (q // 2) % 2, q % 2
            out.append((j, q, 2 * t + 8 * h + x, 16 * j + 8 * b + g))
    return out


def marlin_lane_scales(lane: int) -> list[tuple[int, int]]:
    """(byte, n) of the 16 scale bytes lane `lane` loads per 32-group and tile (byte 0..63 of the group row's
    64-byte chunk of the tile, n 0..63 within the tile): the columns 2t, 2t+1 of every n8 block that its mma
    C fragment (c0, c1 and c2, c3: rows groupID and groupID + 8) holds."""
    if not 0 <= lane < 32:
        raise ValueError(f"lane: expected 0..31, found {lane}")
    t = lane % 4
    return [(16 * t + 8 * x + m, 2 * t + x + 8 * MARLIN_SCALE_BLOCK[m]) for x in range(2) for m in range(8)]


def decode_e2m1_pair_bf16x2(word: torch.Tensor, pair: int) -> torch.Tensor:
    """Nibbles `pair` and `pair` + 4 (pair 0..3) of each int32 word as a bf16x2 bit pattern (int32; low half
    the first nibble), decoded as the GPU will: a shift to the pair, two masked shifts into place, an or, one bf16x2 multiply
    by 2^126."""
    if word.dtype != _I32:
        raise ValueError(f"word: expected int32, found {word.dtype}")
    if not 0 <= pair < 4:
        raise ValueError(f"pair: expected 0..3, found {pair}")
    v = word >> (4 * pair)  # the nibbles at bits 0..3 and 16..19; the sign fill lands above bit 19
    raw = ((v & 0x00080008) << 12) | ((v & 0x00070007) << 6)  # sign -> bit 15, magnitude -> bits 8..6
    # bf16x2 multiply, low half first as in a register (and in a little-endian host's view); exact: a power of two
    halves = raw.contiguous().unsqueeze(-1).view(torch.bfloat16) * _BF16_2P
    return halves.view(_I32).squeeze(-1)


def e8m0_to_f32_bits(s: torch.Tensor) -> torch.Tensor:
    """The fp32 bit pattern (int32) of 2^(s-127) for UE8M0 bytes s: s in the exponent field, and for s = 0 the
    subnormal 2^-127 (0x00400000). s = 255 (NaN in OCP MX) gives +inf, as semantics.dequant_mxfp4's
    2^(255-127) does: either way non-finite, and checkpoints never hold it (scales come from finite amax)."""
    if s.dtype not in (torch.uint8, _I32):
        raise ValueError(f"s: expected uint8 or int32, found {s.dtype}")
    s = s.to(_I32)
    return (s << 23) | ((s == 0).to(_I32) << 22)


def _experts(a: torch.Tensor, b: torch.Tensor, a_name: str, b_name: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A 2-D single expert as a batch of one (both tensors alike)."""
    if a.dim() != b.dim():
        raise ValueError(f"{b_name}: expected {a.dim()} dims like {a_name}, found {b.dim()} ({list(b.shape)})")
    return (a.unsqueeze(0), b.unsqueeze(0), True) if a.dim() == 2 else (a, b, False)


def _checkpoint_dims(packed: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int]:
    if packed.dtype != torch.uint8 or packed.dim() != 3:
        raise ValueError(f"packed: expected uint8 [E, N, K/2] or [N, K/2], found {packed.dtype} {list(packed.shape)}")
    e, n, k = packed.shape[0], packed.shape[1], 2 * packed.shape[2]
    if n % ALIGN_N or k % ALIGN_K:
        raise ValueError(f"packed: Marlin needs N % {ALIGN_N} == 0 and K % {ALIGN_K} == 0, found N={n}, K={k}")
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu) or list(scales.shape) != [e, n, k // GROUP]:
        raise ValueError(f"scales: expected uint8 (or float8_e8m0fnu) {[e, n, k // GROUP]}, found {scales.dtype} {list(scales.shape)}")
    return e, n, k


def _marlin_dims(qweight: torch.Tensor, qscale: torch.Tensor) -> tuple[int, int, int]:
    if qweight.dtype != _I32 or qweight.dim() != 3:
        raise ValueError(f"qweight: expected int32 [E, K/16, 2N] or [K/16, 2N], found {qweight.dtype} {list(qweight.shape)}")
    e, k, n = qweight.shape[0], TILE_K * qweight.shape[1], qweight.shape[2] // 2
    if qweight.shape[2] % 2 or n % ALIGN_N or k % ALIGN_K:
        raise ValueError(f"qweight: Marlin needs N % {ALIGN_N} == 0 and K % {ALIGN_K} == 0, found 2N={qweight.shape[2]}, K={k}")
    if qscale.dtype not in (torch.uint8, torch.float8_e8m0fnu) or list(qscale.shape) != [e, k // GROUP, n]:
        raise ValueError(f"qscale: expected uint8 or float8_e8m0fnu {[e, k // GROUP, n]}, found {qscale.dtype} {list(qscale.shape)}")
    return e, n, k


@functools.cache
def _scale_columns() -> torch.Tensor:
    """Column (within the tile) of each of the 64 scale bytes of a group row's chunk."""
    return torch.tensor([c // 8 + 8 * MARLIN_SCALE_BLOCK[c % 8] for c in range(TILE_N)])


@functools.cache
def _lane_maps() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """marlin_lane_elements as k and n [lane, word, nibble], and the scale columns marlin_lane_scales gives
    each threadID [t, 16] (its bytes are 16t..16t+15)."""
    k = torch.zeros(32, 4, 8, dtype=torch.long)
    n = torch.zeros(32, 4, 8, dtype=torch.long)
    for lane in range(32):
        for j, q, kk, nn in marlin_lane_elements(lane):
            k[lane, j, q], n[lane, j, q] = kk, nn
    sn = torch.tensor([[nn for _, nn in marlin_lane_scales(t)] for t in range(4)])
    return k, n, sn


def marlin_repack_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint MXFP4 (packed uint8 [E, N, K/2], scales uint8 [E, N, K/32]; or one expert, 2-D) to vLLM's
    Marlin layout: qweight int32 [E, K/16, 2N] and qscale uint8 [E, K/32, N], the bytes of
    `prepare_moe_fp4_layer_for_marlin` (its scales' bf16 round trip is exact for powers of two, all 256
    bytes included, so the bytes are only permuted)."""
    packed, scales, single = _experts(packed, scales, "packed", "scales")
    e, n, k = _checkpoint_dims(packed, scales)
    p = packed.to(_I32)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(e, n, k)
    # B[k, n] with k = 16kt + 8h + 2t + x and n = 64T + 16j + 8b + g, to word (kt, T, lane 4g+t, j), nibble 4x+2b+h
    b = codes.transpose(1, 2).reshape(e, k // 16, 2, 4, 2, n // 64, 4, 2, 8)  # e kt h t x T j b g
    b = b.permute(0, 1, 5, 8, 3, 6, 4, 7, 2).reshape(e, k // 16, 2 * n, 8).to(torch.int64)
    words = (b << (4 * torch.arange(8))).sum(-1)
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(_I32)  # the unsigned word as int32
    s = scales.view(torch.uint8).transpose(1, 2).reshape(e, k // GROUP, n // TILE_N, TILE_N)
    qscale = s[..., _scale_columns()].reshape(e, k // GROUP, n)
    return (qweight[0], qscale[0]) if single else (qweight, qscale)


def marlin_unpack_mxfp4(qweight: torch.Tensor, qscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of marlin_repack_mxfp4: the checkpoint's packed uint8 [E, N, K/2] and scales uint8
    [E, N, K/32] (2-D in, 2-D out). qscale may be vLLM's float8_e8m0fnu."""
    qweight, qscale, single = _experts(qweight, qscale, "qweight", "qscale")
    e, n, k = _marlin_dims(qweight, qscale)
    nib = (qweight.unsqueeze(-1) >> (4 * torch.arange(8, dtype=_I32))) & 0xF  # e kt (T g t j) (x b h)
    nib = nib.reshape(e, k // 16, n // 64, 8, 4, 4, 2, 2, 2)  # e kt T g t j x b h
    codes = nib.permute(0, 1, 8, 4, 6, 2, 5, 7, 3).reshape(e, k, n).transpose(1, 2)  # back to e kt h t x T j b g
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    s = qscale.view(torch.uint8).reshape(e, k // GROUP, n // TILE_N, TILE_N)
    scales = s[..., torch.argsort(_scale_columns())].reshape(e, k // GROUP, n).transpose(1, 2).contiguous()
    return (packed[0], scales[0]) if single else (packed, scales)


def dequant_mxfp4_marlin(qweight: torch.Tensor, qscale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [E, N, K] (or [N, K]) in `dtype`, read from the Marlin layout through the lanes' maps
    (marlin_lane_elements, marlin_lane_scales), not through marlin_unpack_mxfp4: equal, bit for bit, to
    semantics.dequant_mxfp4 of the checkpoint tensors."""
    qweight, qscale, single = _experts(qweight, qscale, "qweight", "qscale")
    e, n, k = _marlin_dims(qweight, qscale)
    lk, ln, sn = _lane_maps()
    words = qweight.reshape(e, k // 16, n // 64, 32, 4, 1)
    nib = ((words >> (4 * torch.arange(8, dtype=_I32))) & 0xF).long()  # e kt T lane word nibble
    rows = (16 * torch.arange(k // 16)).view(-1, 1, 1, 1, 1) + lk
    cols = (64 * torch.arange(n // 64)).view(1, -1, 1, 1, 1) + ln
    codes = torch.empty(e, k, n, dtype=torch.long)
    codes[:, rows, cols] = nib
    s = torch.empty(e, k // GROUP, n, dtype=torch.uint8)
    s[:, :, (64 * torch.arange(n // 64)).view(-1, 1, 1) + sn] = qscale.view(torch.uint8).reshape(e, k // GROUP, n // 64, 4, 16)
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    vals = lut[codes] * torch.exp2(s.to(torch.float32) - 127.0).repeat_interleave(GROUP, dim=1)
    w = vals.transpose(1, 2).to(dtype)
    return w[0] if single else w


def marlin_gemv(qweight: torch.Tensor, qscale: torch.Tensor, x: torch.Tensor, acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [E, N] = W x per expert (x [E, K] or [K]) computed the way a consumer warp will: each lane's words
    decoded by decode_e2m1_pair_bf16x2, the products with x summed in `acc_dtype` per 32-group (the mma's
    fp32 accumulators when acc_dtype is float32), each group's partial times its 2^(s-127) from
    e8m0_to_f32_bits, the groups summed. The summation order is not the kernel's: with float32 it equals
    x @ W.T within fp32 rounding; with float64 and x whose products add exactly, it equals it exactly."""
    qweight, qscale, single = _experts(qweight, qscale, "qweight", "qscale")
    e, n, k = _marlin_dims(qweight, qscale)
    if x.shape[-1] != k or x.dim() not in (1, 2) or (x.dim() == 2 and x.shape[0] != e):
        raise ValueError(f"x: expected [{e}, {k}] or [{k}], found {list(x.shape)}")
    lk, ln, sn = _lane_maps()
    words = qweight.reshape(e, k // 16, n // 64, 32, 4)
    # per (pair, half): nibble pair + 4*half, the order the bf16x2 halves come out in
    order = torch.tensor([p + 4 * h for p in range(4) for h in range(2)])
    bits = torch.stack([decode_e2m1_pair_bf16x2(words, p) for p in range(4)], dim=-1)  # e kt T lane word pair
    halves = torch.stack([bits & 0xFFFF, (bits >> 16) & 0xFFFF], dim=-1).flatten(-2)  # ... (pair half)
    w = (halves << 16).view(torch.float32).to(acc_dtype)  # bf16 -> fp32 is a shift
    kk = (16 * torch.arange(k // 16)).view(-1, 1, 1, 1, 1) + lk[:, :, order]
    nn = (64 * torch.arange(n // 64)).view(1, -1, 1, 1, 1) + ln[:, :, order]
    xs = x.expand(e, k).to(acc_dtype)[:, kk]
    partial = torch.zeros(e, (k // GROUP) * n, dtype=acc_dtype)
    partial.index_add_(1, ((kk // GROUP) * n + nn).flatten(), (w * xs).reshape(e, -1))
    bits_s = e8m0_to_f32_bits(qscale.view(torch.uint8)).reshape(e, k // GROUP, n // 64, 4, 16)
    scale = torch.empty(e, k // GROUP, n, dtype=_I32)
    scale[:, :, (64 * torch.arange(n // 64)).view(-1, 1, 1) + sn] = bits_s
    y = (partial.view(e, k // GROUP, n) * scale.view(torch.float32).to(acc_dtype)).sum(1)
    return y[0] if single else y
