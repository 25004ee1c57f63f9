"""MXFP4 against compressed-tensors, the authority for `mxfp4-pack-quantized` (spec 5.5, open
question 13.2): (a) `ir.semantics.dequant_mxfp4` decodes bytes that compressed-tensors packed exactly as
compressed-tensors' own decoder does, and (b) our quantizer (`compiler.checkpoint.quantize_mxfp4`)
writes the same bytes as compressed-tensors' quantization of the same input, rounding corner cases
included. The finding (low nibble = even input, sign bit 3, scale byte 2^(s-127)) is spelled out by
`test_byte_layout`."""

from __future__ import annotations

import pytest
import torch

from k3mk.compiler.checkpoint import quantize_mxfp4
from k3mk.ir.semantics import dequant_mxfp4

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import MXFP4A16  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

SCHEME = QuantizationScheme(targets=["Linear"], **MXFP4A16)  # weights: FP4 E2M1, group 32, UE8M0 scales


def ct_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' path for a [out, in] weight: min/max group qparams (what its minmax observer
    feeds), then the mxfp4-pack-quantized compressor."""
    groups = w.unflatten(-1, (-1, 32))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights)
    out = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, SCHEME)
    return out["weight_packed"], out["weight_scale"]


def ct_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, SCHEME)["weight"]


def random_weight(shape: tuple[int, int], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gaussian rows whose magnitudes span several octaves, so many scale exponents occur."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp(2.0 * torch.randn(shape[0], 1, generator=g))
    return (torch.randn(shape, generator=g) * rows).to(dtype)


SHAPES = [(8, 64), (48, 256), (3, 1024)]


@pytest.mark.parametrize("shape", SHAPES)
def test_dequant_matches_compressed_tensors_on_its_bytes(shape):
    for seed in range(3):
        packed, scale = ct_quantize(random_weight(shape, seed))
        assert torch.equal(dequant_mxfp4(packed, scale, torch.float32), ct_decode(packed, scale).float())


def test_dequant_matches_compressed_tensors_on_every_byte():
    # every packed byte, against a spread of scale exponents (kept where bf16, the decoder's output, is exact)
    packed = torch.arange(256, dtype=torch.uint8).repeat(8).reshape(16, 128)
    scale = torch.randint(100, 160, (16, 8), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    assert torch.equal(dequant_mxfp4(packed, scale, torch.float32), ct_decode(packed, scale).float())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_bytes_match_compressed_tensors(shape, dtype):
    for seed in range(3):
        w = random_weight(shape, seed, dtype)
        ours, theirs = quantize_mxfp4(w), ct_quantize(w)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_quantizer_stacked_experts_quantize_row_by_row():
    w = torch.stack([random_weight((16, 64), seed) for seed in range(4)])  # [E, out, in]
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (4, 16, 32) and scale.shape == (4, 16, 2)
    for e in range(4):
        p, s = ct_quantize(w[e])
        assert torch.equal(packed[e], p) and torch.equal(scale[e], s)


def test_quantizer_corner_cases_match_compressed_tensors():
    g = torch.Generator().manual_seed(0)
    # every E2M1 midpoint (a tie), grid points, values past 6 (clamped), and small values around 0
    grid = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.5, 3.0, 4.0, 5.5, 0.1, 0.3])
    rows = grid.repeat(16, 2) * torch.where(torch.rand(16, 32, generator=g) < 0.5, -1.0, 1.0)
    rows = rows * 2.0 ** torch.randint(-8, 8, (16, 1), generator=g).float()
    rows[0] = 0.0  # all-zero group: scale byte 0
    rows[1] = -0.0  # -0.0 encodes as +0
    rows[2, 1:] = 0.0
    rows[2, 0] = -1e-3  # a lone negative that sets the scale
    rows[3] *= 1.75 / 6  # group max with mantissa exactly 1.75: rounds the power of two up
    rows[4] *= (1.75 - 2**-20) / 6  # just below 1.75: rounds down, so the max clamps to 6
    rows[5] *= 1.5 / 6
    rows[6] = rows[6] * 1e-39  # subnormal group max
    rows[7, :] = torch.linspace(-7, 7, 32)
    ours, theirs = quantize_mxfp4(rows), ct_quantize(rows)
    assert torch.equal(ours[1], theirs[1])
    assert torch.equal(ours[0], theirs[0])


def test_byte_layout():
    """The format as a worked example: inputs (1.0, -6.0) in a group whose max |w| is 6."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 1.0, -6.0, -0.1
    packed, scale = quantize_mxfp4(w)
    # low nibble = even input: code(1.0) = 2; high nibble = odd input: sign 8 | code(6.0) = 7
    assert packed[0, 0].item() == 0xF2
    assert packed[0, 1].item() == 0x08  # -0.1 rounds to zero but keeps its sign bit
    assert scale[0, 0].item() == 127  # 2^(127 - 127) = 1: max 6 = 1.5 * 2^2 maps onto E2M1's 6
    assert dequant_mxfp4(packed, scale, torch.float32)[0, :3].tolist() == [1.0, -6.0, -0.0]
    assert torch.equal(ct_quantize(w)[0], packed)
