"""vLLM's Marlin W4A16 MXFP4 layout (k3mk.ir.marlin): the repack and its inverse, the dequantisation read
through the lanes' maps against semantics.dequant_mxfp4, the lane maps against the PTX mma.m16n8k16 bf16
fragments, the bit-level E2M1 decode and UE8M0 scale, and a GEMV computed the kernel's way. That the
repack gives vLLM's own bytes is pinned in tests/runtime/test_engine_contract_vllm.py."""

from __future__ import annotations

import pytest
import torch

from k3mk.ir.marlin import (
    DECODE_P,
    decode_e2m1_pair_bf16x2,
    dequant_mxfp4_marlin,
    e8m0_to_f32_bits,
    marlin_gemv,
    marlin_lane_elements,
    marlin_lane_scales,
    marlin_repack_mxfp4,
    marlin_unpack_mxfp4,
)
from k3mk.ir.semantics import E2M1_VALUES, dequant_mxfp4

# (experts, N out, K in): w13-like, TP16-like (one 64-column tile), w2-like at TP16 (K = 64: four k-tiles)
SHAPES = [(3, 128, 256), (2, 64, 256), (2, 256, 64)]
E2M1 = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)  # by code: bit 3 the sign


def mxfp4(seed: int, e: int, n: int, k: int, lo: int = 110, hi: int = 136) -> tuple[torch.Tensor, torch.Tensor]:
    """Random checkpoint MXFP4 experts: every byte (so all 16 codes in both nibbles), scales in [lo, hi)."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(lo, hi, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    return packed, scales


def bits16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).view(torch.int16)


@pytest.mark.parametrize("shape", SHAPES)
def test_repack_shapes_and_round_trip(shape):
    e, n, k = shape
    packed, scales = mxfp4(1, *shape)
    qweight, qscale = marlin_repack_mxfp4(packed, scales)
    assert (qweight.dtype, list(qweight.shape), qscale.dtype, list(qscale.shape)) == (torch.int32, [e, k // 16, 2 * n], torch.uint8, [e, k // 32, n])
    back = marlin_unpack_mxfp4(qweight, qscale)
    assert torch.equal(back[0], packed) and torch.equal(back[1], scales)
    assert torch.equal(marlin_unpack_mxfp4(qweight, qscale.view(torch.float8_e8m0fnu))[1], scales)  # vLLM's dtype


def test_one_expert_2d_is_the_batched_expert():
    packed, scales = mxfp4(2, 3, 128, 256)
    qweight, qscale = marlin_repack_mxfp4(packed, scales)
    one = marlin_repack_mxfp4(packed[1], scales[1])
    assert torch.equal(one[0], qweight[1]) and torch.equal(one[1], qscale[1])
    back = marlin_unpack_mxfp4(*one)
    assert torch.equal(back[0], packed[1]) and torch.equal(back[1], scales[1])
    assert torch.equal(dequant_mxfp4_marlin(*one, torch.float32), dequant_mxfp4(packed[1], scales[1], torch.float32))


def test_scale_bytes_survive_vllms_bf16_round_trip():
    """vLLM converts the e8m0 scales to bf16, permutes, and converts back: the identity on all 256 bytes
    (0 -> the bf16 subnormal 2^-127, 255 -> NaN -> 255), so permuting the bytes directly is the same."""
    s = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(s.view(torch.float8_e8m0fnu).to(torch.bfloat16).to(torch.float8_e8m0fnu).view(torch.uint8), s)


def test_scale_layout_is_vllms_two_permutations():
    """Per 64 scales of a group row: scale_perm's 8x8 transpose (position 8i + j takes column i + 8j), then
    mxfp4_marlin_process_scales' [0, 2, 1, 3] within each 4 positions (docs/engine_contract.md, section 2);
    written out here apart from k3mk.ir.marlin, which derives both its repack and its lane maps from one table."""
    transpose = [i + 8 * j for i in range(8) for j in range(8)]
    perm = [transpose[4 * (c // 4) + (0, 2, 1, 3)[c % 4]] for c in range(64)]
    n, k = 128, 256
    columns = torch.arange(n, dtype=torch.uint8).view(n, 1)
    scales = (columns + 100 * (torch.arange(k // 32, dtype=torch.uint8) % 2)).unsqueeze(0)  # [1, N, K/32], rows distinct
    packed = torch.randint(0, 256, (1, n, k // 2), generator=torch.Generator().manual_seed(10), dtype=torch.uint8)
    qscale = marlin_repack_mxfp4(packed, scales)[1][0]
    for g in range(k // 32):
        row = scales[0, :, g]
        assert torch.equal(qscale[g], torch.cat([row[64 * t : 64 * t + 64][perm] for t in range(n // 64)]))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequant_from_the_marlin_layout_is_semantics(shape, dtype):
    packed, scales = mxfp4(3, *shape)
    scales.view(-1)[:4] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)  # the extremes, non-finite included
    got = dequant_mxfp4_marlin(*marlin_repack_mxfp4(packed, scales), dtype)
    want = dequant_mxfp4(packed, scales, dtype)
    assert got.shape == want.shape == (shape[0], shape[1], shape[2])
    view = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(view), want.view(view))


def test_lane_elements_cover_a_tile_once_as_the_mma_b_fragments():
    """The 32 lanes' 4 words x 8 nibbles are the 16x64 tile's 1024 codes once each; nibbles (i, i+4), i = 2b + h,
    of word j are bf16x2 register h of the m16n8k16 B fragment of n8 block 2j + b (PTX ISA: b0, b1 at
    k = 2*threadID + {0, 1}, b2, b3 at k = 2*threadID + 8 + {0, 1}, n = groupID), low half first."""
    seen = set()
    for lane in range(32):
        g, t = lane // 4, lane % 4
        elements = {(w, q): (k, n) for w, q, k, n in marlin_lane_elements(lane)}
        assert len(elements) == 32 and set(elements) == {(w, q) for w in range(4) for q in range(8)}
        seen |= set(elements.values())
        for block in range(8):
            for reg in range(2):
                i, word = 2 * (block % 2) + reg, block // 2
                pair = [elements[word, i], elements[word, i + 4]]
                assert pair == [(2 * t + 8 * reg + half, 8 * block + g) for half in range(2)]
    assert seen == {(k, n) for k in range(16) for n in range(64)}


def test_lane_scales_are_the_mma_c_fragment_columns():
    """A lane's 16 scale bytes are one aligned 16-byte vector (16 * threadID) holding the scales of exactly the
    columns of its C fragment (c0, c1 at 2*threadID + {0, 1}, and c2, c3 the same columns 8 rows down) in
    each of the tile's 8 n8 blocks; the 4 threadIDs' vectors are the 64 bytes once each."""
    owner = {}
    for lane in range(32):
        t = lane % 4
        entries = marlin_lane_scales(lane)
        assert sorted(b for b, _ in entries) == list(range(16 * t, 16 * t + 16))
        assert sorted(n for _, n in entries) == sorted(8 * block + 2 * t + c for block in range(8) for c in range(2))
        for byte, n in entries:
            assert owner.setdefault(byte, n) == n
    assert sorted(owner) == list(range(64)) and sorted(owner.values()) == list(range(64))


@pytest.mark.parametrize("pair", range(4))
def test_decode_is_bit_exact_for_all_256_code_pairs(pair):
    """Nibbles pair and pair + 4 of a word (the other six random) decode to bf16(E2M1 value) bit for bit,
    -0 and the subnormal-before-scaling 0.5 included."""
    gen = torch.Generator().manual_seed(4 + pair)
    lo, hi = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    lo, hi = lo.flatten().to(torch.int32), hi.flatten().to(torch.int32)
    word = torch.randint(-(2**31), 2**31, (256,), generator=gen, dtype=torch.int64)
    word = word & ~((0xF << (4 * pair)) | (0xF << (4 * pair + 16))) | (lo.long() << (4 * pair)) | (hi.long() << (4 * pair + 16))
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    got = decode_e2m1_pair_bf16x2(word, pair)
    values = torch.tensor(E2M1, dtype=torch.float32)
    assert torch.equal((got & 0xFFFF).to(torch.int16), bits16(values[lo]))
    assert torch.equal(((got >> 16) & 0xFFFF).to(torch.int16), bits16(values[hi]))
    assert DECODE_P == 126


def test_e8m0_scale_bits_are_exp2_for_all_256():
    s = torch.arange(256, dtype=torch.int32)
    got = e8m0_to_f32_bits(s)
    assert torch.equal(got, torch.exp2(s.float() - 127).view(torch.int32))
    assert got[0].item() == 0x00400000 and got[255].view(torch.float32).item() == float("inf")
    assert torch.equal(e8m0_to_f32_bits(s.to(torch.uint8)), got)


@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_the_kernels_way_is_x_times_w(shape):
    """fp32 accumulation: |y - x @ W.T| <= 2 K 2^-24 (|W| @ |x|) elementwise (each side's fp32 sums err by at
    most K 2^-24 of the sum of magnitudes; the power-of-two scaling is exact)."""
    e, n, k = shape
    packed, scales = mxfp4(5, *shape)
    x = torch.randn(e, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    w = dequant_mxfp4(packed, scales, torch.float32)
    y = marlin_gemv(*marlin_repack_mxfp4(packed, scales), x)
    want = torch.einsum("enk,ek->en", w, x.float())
    bound = 2 * k * 2.0**-24 * torch.einsum("enk,ek->en", w.abs(), x.float().abs())
    assert y.dtype == torch.float32 and y.shape == (e, n)
    assert ((y - want).abs() <= bound).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_accumulated_in_float64_is_exact(shape):
    """x of 8-bit integers / 128 (exact in bf16): every product is a multiple of 2^-25 below 2^11 and every
    sum below 2^19, so float64 adds them exactly in any order, and the kernel's way equals x @ W.T."""
    e, n, k = shape
    packed, scales = mxfp4(7, *shape)
    gen = torch.Generator().manual_seed(8)
    x = (torch.randint(-128, 128, (e, k), generator=gen) / 128).to(torch.bfloat16)
    x[x == 0] = 1.0  # never zeros
    w = dequant_mxfp4(packed, scales, torch.float64)
    y = marlin_gemv(*marlin_repack_mxfp4(packed, scales), x, torch.float64)
    assert torch.equal(y, torch.einsum("enk,ek->en", w, x.double()))
    one = marlin_gemv(*marlin_repack_mxfp4(packed[0], scales[0]), x[0], torch.float64)
    assert torch.equal(one, y[0])


def test_bad_tensors_are_refused_by_name():
    packed, scales = mxfp4(9, 2, 128, 256)
    qweight, qscale = marlin_repack_mxfp4(packed, scales)
    refused = [
        (lambda: marlin_repack_mxfp4(packed.to(torch.int32), scales), r"packed: expected uint8 \[E, N, K/2\]"),
        (lambda: marlin_repack_mxfp4(packed[:, :96], scales[:, :96]), r"packed: Marlin needs N % 64 == 0 and K % 64 == 0, found N=96, K=256"),
        (lambda: marlin_repack_mxfp4(packed[..., :80], scales[..., :5]), r"found N=128, K=160"),
        (lambda: marlin_repack_mxfp4(packed, scales[..., :4]), r"scales: expected uint8 \(or float8_e8m0fnu\) \[2, 128, 8\], found torch.uint8 \[2, 128, 4\]"),
        (lambda: marlin_repack_mxfp4(packed, scales[0]), r"scales: expected 3 dims like packed, found 2"),
        (lambda: marlin_unpack_mxfp4(qweight.view(torch.float32), qscale), r"qweight: expected int32 \[E, K/16, 2N\]"),
        (lambda: marlin_unpack_mxfp4(qweight[:, :, :192], qscale), r"qweight: Marlin needs N % 64 == 0 .* found 2N=192"),
        (lambda: dequant_mxfp4_marlin(qweight, qscale[:, :4], torch.float32), r"qscale: expected uint8 or float8_e8m0fnu \[2, 8, 128\], found torch.uint8 \[2, 4, 128\]"),
        (lambda: marlin_gemv(qweight, qscale, torch.ones(3, 256)), r"x: expected \[2, 256\] or \[256\], found \[3, 256\]"),
        (lambda: decode_e2m1_pair_bf16x2(qweight, 4), r"pair: expected 0..3, found 4"),
        (lambda: marlin_lane_elements(32), r"lane: expected 0..31, found 32"),
    ]
    for call, message in refused:
        with pytest.raises(ValueError, match=message):
            call()
