"""Checkpoint I/O (compiler/checkpoint.py) and random weights (compiler/random_weights.py).

- Round trips random weights -> published-format checkpoint -> canonical weights, exactly, for the
  MXFP4 K3 family (k3-tiny) and a small Kimi Linear, single file and sharded, and checks the published
  names, dtypes and layouts on disk (models/TENSORS.md).
- Every way a checkpoint can be wrong gives a CheckpointError naming the file and the tensor;
  every documented equivalent layout loads, including what transformers' save_pretrained writes.
- The random weights keep activations O(1) and route with clear, varied margins (spec 5.2).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from k3mk.compiler import checkpoint
from k3mk.compiler.checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointError, load_checkpoint, save_checkpoint
from k3mk.compiler.config import load_config
from k3mk.compiler.random_weights import random_weights, write_random_checkpoint
from k3mk.compiler.reference import DecodeStep
from k3mk.compiler.weights import weight_specs

# --- configs and fixtures ---------------------------------------------------------------------------


def k3_small():
    """The K3 family (MXFP4 experts, LatentMoE, AttnRes, padded A_log) at a few hundred KB."""
    c = load_config("k3-tiny")
    return c.replace(
        name="k3-small",
        hidden_size=64,
        num_layers=4,
        vocab_size=256,
        dense_intermediate_size=128,
        layer_kinds=("kda", "kda", "kda", "mla"),
        kda=dataclasses.replace(c.kda, num_heads=2, head_dim=32),
        mla=dataclasses.replace(
            c.mla, num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32
        ),
        moe=dataclasses.replace(c.moe, num_experts=4, top_k=2, intermediate_size=64, latent_size=64),
    )


def kimi_linear_small():
    """Kimi Linear at the dims of the transformers model in test_loads_transformers_save_pretrained."""
    c = load_config("kimi-linear-48b-a3b")
    return c.replace(
        name="kimi-linear-small",
        hidden_size=64,
        num_layers=4,
        vocab_size=256,
        dense_intermediate_size=96,
        layer_kinds=("kda", "kda", "kda", "mla"),
        kda=dataclasses.replace(c.kda, num_heads=2, head_dim=32),
        mla=dataclasses.replace(c.mla, num_heads=2, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
        moe=dataclasses.replace(c.moe, num_experts=4, top_k=2, intermediate_size=32),
    )


CONFIG_JSON = {"_comment": "test config built in code"}


def assert_same(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for name, t in expected.items():
        assert loaded[name].dtype == t.dtype, name
        assert torch.equal(loaded[name], t), name


def stored(path: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) of every tensor in a safetensors file."""
    with safe_open(str(path), "pt") as f:
        return {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}


def rewrite(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def tiny():
    config = load_config("k3-tiny")
    return config, random_weights(config, seed=0)


@pytest.fixture(scope="module")
def kl_checkpoint(tmp_path_factory):
    """A small Kimi Linear checkpoint; tests copy it before breaking it."""
    config = kimi_linear_small()
    weights = random_weights(config, seed=1)
    directory = save_checkpoint(config, weights, tmp_path_factory.mktemp("kl") / "ckpt", config_json=CONFIG_JSON)
    return config, weights, directory


@pytest.fixture
def kl_copy(kl_checkpoint, tmp_path):
    config, weights, directory = kl_checkpoint
    return config, weights, Path(shutil.copytree(directory, tmp_path / "ckpt"))


# --- round trips and the published form ------------------------------------------------------------


def test_k3_tiny_round_trip_single_file_and_decode(tiny, tmp_path):
    config, weights = tiny
    directory = save_checkpoint(config, weights, tmp_path / "ckpt")
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", SINGLE_FILE]
    assert load_config(directory).hash() == config.hash()  # the preset's own JSON was written
    on_disk = stored(directory / SINGLE_FILE)
    assert len(on_disk) == sum(s.shape[0] if ".experts." in s.name else 1 for s in weight_specs(config))
    p = "language_model.model.layers.1"
    assert on_disk[f"{p}.block_sparse_moe.experts.15.w1.weight_packed"] == ([256, 128], "U8")
    assert on_disk[f"{p}.block_sparse_moe.experts.15.w2.weight_scale"] == ([256, 8], "U8")
    assert on_disk[f"{p}.self_attn.A_log"] == ([128], "F32")  # padded, 4 live heads
    fp32 = ("self_attn.q_conv1d.weight", "self_attn.dt_bias", "self_attn.o_norm.weight", "block_sparse_moe.gate.e_score_correction_bias")
    for name in fp32:
        assert on_disk[f"{p}.{name}"][1] == "F32", name
    for name in ("self_attn.q_proj.weight", "block_sparse_moe.gate.weight", "mlp_res_proj.weight"):
        assert on_disk[f"{p}.{name}"][1] == "BF16", name
    assert on_disk["language_model.model.layers.0.mlp.gate_proj.weight"] == ([1024, 512], "BF16")

    loaded = load_checkpoint(config, directory)  # bf16 on disk -> float32 compute, exactly (bf16-exact weights)
    assert_same(loaded, weights)
    model = DecodeStep(config)
    model.load_state_dict(loaded)
    with torch.no_grad():
        logits, _ = model(torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.long), model.new_state(3, 4))
    assert logits.shape == (3, config.vocab_size) and torch.isfinite(logits).all()


def test_k3_tiny_round_trip_sharded_bf16(tiny, tmp_path):
    config, weights = tiny
    limit = 16 * 2**20
    directory = save_checkpoint(config, weights, tmp_path / "ckpt", max_shard_bytes=limit)
    index = json.loads((directory / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4 and not (directory / SINGLE_FILE).exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total = 0
    for shard in shards:
        names = stored(directory / shard)
        assert all(index["weight_map"][n] == shard for n in names)
        size = (directory / shard).stat().st_size
        assert size <= limit + 2**20 or len(names) == 1  # + the header; a larger tensor stands alone
        total += sum(math.prod(s) * {"BF16": 2, "F32": 4, "U8": 1}[d] for s, d in names.values())
    assert index["metadata"]["total_size"] == total
    loaded = load_checkpoint(config, directory, dtype=torch.bfloat16)
    assert_same(loaded, {s.name: weights[s.name].to(s.torch_dtype(torch.bfloat16)) for s in weight_specs(config)})


@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 40_000])
def test_kimi_linear_round_trip(tmp_path, max_shard_bytes):
    config = kimi_linear_small()
    weights = random_weights(config, seed=3)
    directory = save_checkpoint(config, weights, tmp_path / "ckpt", max_shard_bytes=max_shard_bytes, config_json=CONFIG_JSON)
    assert json.loads((directory / "config.json").read_text()) == CONFIG_JSON
    files = sorted(directory.glob("*.safetensors"))
    sharded = max_shard_bytes < 2**20
    assert (directory / INDEX_FILE).exists() == sharded and (len(files) > 1) == sharded
    on_disk = {k: v for f in files for k, v in stored(f).items()}
    p = "model.layers.1"  # no prefix; dtypes per TENSORS.md's kimi-linear table
    assert on_disk[f"{p}.self_attn.A_log"] == ([1, 1, 2, 1], "F32")
    assert on_disk[f"{p}.self_attn.dt_bias"] == ([64], "F32")
    bf16 = ("self_attn.q_conv1d.weight", "self_attn.o_norm.weight", "block_sparse_moe.gate.e_score_correction_bias", "self_attn.g_b_proj.weight")
    for name in bf16:
        assert on_disk[f"{p}.{name}"][1] == "BF16", name
    assert on_disk[f"{p}.block_sparse_moe.experts.3.w2.weight"] == ([64, 32], "BF16")
    assert_same(load_checkpoint(config, directory), weights)


# --- errors ----------------------------------------------------------------------------------------


def test_missing_tensor(kl_copy):
    config, _, directory = kl_copy
    rewrite(directory / SINGLE_FILE, lambda t: t.pop("model.layers.1.self_attn.b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.b_proj\.weight'"):
        load_checkpoint(config, directory)


def test_missing_expert(kl_copy):
    config, _, directory = kl_copy
    rewrite(directory / SINGLE_FILE, lambda t: t.pop("model.layers.2.block_sparse_moe.experts.1.w3.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.block_sparse_moe\.experts\.1\.w3\.weight'"):
        load_checkpoint(config, directory)


def test_k3_without_prefix(tmp_path):
    config = k3_small()
    directory = save_checkpoint(config, random_weights(config, seed=0), tmp_path / "ckpt", config_json=CONFIG_JSON)
    path = directory / SINGLE_FILE
    save_file({k.removeprefix("language_model."): v for k, v in load_file(path).items()}, path)
    expected = r"missing tensor 'language_model\.model\.embed_tokens\.weight' \(expected shape \[256, 64\]\)"
    with pytest.raises(CheckpointError, match=expected + r"; no tensor name starts with 'language_model\.'"):
        load_checkpoint(config, directory)


def test_unknown_tensor(kl_copy):
    config, _, directory = kl_copy
    rewrite(directory / SINGLE_FILE, lambda t: t.update({"model.layers.1.self_attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unknown tensor 'model\.layers\.1\.self_attn\.extra\.weight'"):
        load_checkpoint(config, directory)


def test_wrong_shape(kl_copy):
    config, _, directory = kl_copy
    name = "model.layers.3.self_attn.kv_b_proj.weight"
    rewrite(directory / SINGLE_FILE, lambda t: t.update({name: t[name].T.contiguous()}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{name}': expected shape \[128, 32\], found \[32, 128\]"):
        load_checkpoint(config, directory)


def test_integer_where_float_expected(kl_copy):
    config, _, directory = kl_copy
    rewrite(directory / SINGLE_FILE, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    expected = r"tensor 'model\.norm\.weight': expected dtype F32 or BF16 or F16 or F64 for a compute weight, found I32"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(config, directory)


def test_float_where_mxfp4_bytes_expected(tmp_path):
    config = k3_small()
    directory = save_checkpoint(config, random_weights(config, seed=0), tmp_path / "ckpt", config_json=CONFIG_JSON)
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"
    rewrite(directory / SINGLE_FILE, lambda t: t.update({name: t[name].float()}))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}': expected dtype U8 for MXFP4 bytes, found F32"):
        load_checkpoint(config, directory)


def test_truncated_file(kl_copy):
    config, _, directory = kl_copy
    path = directory / SINGLE_FILE
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"{path}: not a readable safetensors file"):
        load_checkpoint(config, directory)


def test_missing_shard(tmp_path):
    config = kimi_linear_small()
    directory = save_checkpoint(config, random_weights(config, seed=0), tmp_path / "ckpt", max_shard_bytes=40_000, config_json=CONFIG_JSON)
    index = json.loads((directory / INDEX_FILE).read_text())
    shard = index["weight_map"]["model.layers.2.self_attn.q_proj.weight"]
    (directory / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"shard '{shard}' \(holding e\.g\. tensor '[^']+'\) is missing"):
        load_checkpoint(config, directory)


def test_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=f"no {SINGLE_FILE} and no {INDEX_FILE}"):
        load_checkpoint(kimi_linear_small(), tmp_path)


def _plant(t: torch.Tensor, value: float, generator: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """A copy of `t` with `value` at a random element; the element's index."""
    t = t.clone()
    flat = int(torch.randint(t.numel(), (1,), generator=generator))
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), t.shape)]
    t[tuple(index)] = value
    return t, index


@pytest.mark.parametrize(
    "name, value",
    [
        ("model.layers.1.self_attn.q_proj.weight", float("nan")),  # a NaN in a projection
        ("model.embed_tokens.weight", float("inf")),  # an Inf in the embedding
        ("model.layers.0.mlp.down_proj.weight", float("-inf")),
        ("model.layers.2.self_attn.A_log", float("nan")),  # an fp32 parameter
    ],
)
def test_non_finite_weights_are_refused(kl_copy, name, value):
    config, _, directory = kl_copy
    generator = torch.Generator().manual_seed(len(name))
    index = []

    def plant(t):
        t[name], found = _plant(t[name], value, generator)
        index.extend(found)

    rewrite(directory / SINGLE_FILE, plant)
    stored_index = index if name.endswith(".weight") else [index[2]]  # A_log is stored [1, 1, H, 1], loaded as [H]
    expected = rf"model\.safetensors: tensor '{re.escape(name)}' holds a non-finite value at {re.escape(str(stored_index))} \({value}; 1 in all\)"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(config, directory)


def test_values_beyond_bfloat16_are_refused(kl_copy):
    """An F32 value that is finite but beyond bf16's largest (3.39e38) becomes Inf in the compute dtype: refused there."""
    config, _, directory = kl_copy
    name = "model.layers.3.self_attn.o_proj.weight"
    rewrite(directory / SINGLE_FILE, lambda t: t.update({name: _plant(t[name].float(), 3.4e38, torch.Generator().manual_seed(5))[0]}))  # stored F32
    load_checkpoint(config, directory, dtype=torch.float32)  # fine in float32
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(name)}' holds a non-finite value"):
        load_checkpoint(config, directory, dtype=torch.bfloat16)


def test_mxfp4_nan_scale_is_refused(tmp_path):
    """UE8M0 scale byte 0xFF is NaN: the 32 weights of its group would all dequantise to NaN."""
    config = k3_small()
    directory = save_checkpoint(config, random_weights(config, seed=2), tmp_path / "ckpt", config_json=CONFIG_JSON)
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    generator = torch.Generator().manual_seed(9)
    index = []

    def plant(t):
        t[name], found = _plant(t[name], 0xFF, generator)
        index.extend(found)

    rewrite(directory / SINGLE_FILE, plant)
    expected = rf"tensor '{re.escape(name)}' holds the MXFP4 scale byte 0xff \(UE8M0 NaN\) at {re.escape(str(index))}"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(config, directory)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_an_index_pointing_outside_is_refused(tmp_path, shard):
    config = kimi_linear_small()
    directory = save_checkpoint(config, random_weights(config, seed=0), tmp_path / "ckpt", max_shard_bytes=40_000, config_json=CONFIG_JSON)
    index = json.loads((directory / INDEX_FILE).read_text())
    name = sorted(index["weight_map"])[len(shard) % len(index["weight_map"])]
    outside = (directory / shard).resolve() if not shard.startswith("/") else Path(shard)
    if not shard.startswith("/"):
        shutil.copyfile(directory / index["weight_map"][name], outside)  # it exists: only the path is wrong
    index["weight_map"][name] = shard
    (directory / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(name)}' points to shard '{re.escape(shard)}', outside the checkpoint directory"):
        load_checkpoint(config, directory)


# --- equivalent layouts ---------------------------------------------------------------------------


def test_a_log_layouts(tmp_path):
    """K3 writes A_log padded to 128 (the real checkpoint's F32[128]); [H] and Kimi Linear's [1, 1, H, 1]
    load too, and the padding is ignored; any other length is an error listing the accepted shapes."""
    config = k3_small()
    weights = random_weights(config, seed=0)
    directory = save_checkpoint(config, weights, tmp_path / "ckpt", config_json=CONFIG_JSON)
    name = "language_model.model.layers.0.self_attn.A_log"
    a_log = weights["model.layers.0.self_attn.A_log"]
    padded = torch.cat([a_log, torch.full((126,), 7.0)])  # garbage padding
    for form in (padded, a_log, a_log.reshape(1, 1, 2, 1), a_log.to(torch.float16)):
        rewrite(directory / SINGLE_FILE, lambda t: t.update({name: form}))
        assert torch.equal(load_checkpoint(config, directory)["model.layers.0.self_attn.A_log"], form.flatten()[:2].float())
    rewrite(directory / SINGLE_FILE, lambda t: t.update({name: torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=rf"'{name}': expected shape \[2\] or \[128\] or \[1, 1, 2, 1\], found \[3\]"):
        load_checkpoint(config, directory)


class _CountingHandle:
    """A safe_open handle that records which tensors were read whole."""

    def __init__(self, handle, whole: list[str]):
        self.handle, self.whole = handle, whole

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def get_tensor(self, name):
        self.whole.append(name)
        return self.handle.get_tensor(name)


@pytest.mark.parametrize("make,max_shard_bytes", [(k3_small, 5 * 2**30), (kimi_linear_small, 40_000)])
def test_a_rank_reads_only_its_pieces(make, max_shard_bytes, tmp_path, monkeypatch):
    """With a TP2 artifact's shard table, each rank loads exactly its pieces of the full weights (the
    routed experts' within each expert), reading split tensors as slices, never whole (A_log excepted:
    K3 stores it padded, a layout that is read whole and then cut)."""
    from k3mk.passes.tp_shard import weight_split
    from k3mk.runtime.tp import rank_pieces

    config = make()
    weights = random_weights(config, seed=2)
    directory = save_checkpoint(config, weights, tmp_path / "ckpt", max_shard_bytes=max_shard_bytes, config_json=CONFIG_JSON)
    shards = {s.name: {"dim": weight_split(s.name), "parts": 2, "groups": 1} for s in weight_specs(config) if weight_split(s.name) is not None}
    expected = [rank_pieces(load_checkpoint(config, directory, torch.bfloat16), shards, rank) for rank in range(2)]
    whole: list[str] = []
    real_open = checkpoint._open
    monkeypatch.setattr(checkpoint, "_open", lambda path, stack: _CountingHandle(real_open(path, stack), whole))
    for rank in range(2):
        whole.clear()
        assert_same(load_checkpoint(config, directory, torch.bfloat16, shards=shards, rank=rank), expected[rank])
        canonical = {re.sub(r"\.experts\.\d+\.", ".experts.", n.removeprefix(config.checkpoint_prefix)) for n in whole}
        assert canonical & set(shards) == {n for n in shards if n.endswith(".A_log")}


def test_dense_mlp_under_block_sparse_moe(kl_copy):
    config, weights, directory = kl_copy

    def move(t):
        for proj in ("gate", "up", "down"):
            t[f"model.layers.0.block_sparse_moe.{proj}_proj.weight"] = t.pop(f"model.layers.0.mlp.{proj}_proj.weight")

    rewrite(directory / SINGLE_FILE, move)
    assert_same(load_checkpoint(config, directory), weights)
    both = "model.layers.0.mlp.up_proj.weight", "model.layers.0.block_sparse_moe.up_proj.weight"
    rewrite(directory / SINGLE_FILE, lambda t: t.update({both[0]: t[both[1]].clone()}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' is stored under two names"):
        load_checkpoint(config, directory)


def test_k3_skips_other_towers_but_not_unknown_text_tensors(tmp_path):
    config = k3_small()
    weights = random_weights(config, seed=0)
    directory = save_checkpoint(config, weights, tmp_path / "ckpt", config_json=CONFIG_JSON)
    other_towers = {"vision_tower.blocks.0.weight": torch.zeros(4), "mm_projector.proj.weight": torch.zeros(4)}
    rewrite(directory / SINGLE_FILE, lambda t: t.update(other_towers))
    assert_same(load_checkpoint(config, directory), weights)
    rewrite(directory / SINGLE_FILE, lambda t: t.update({"language_model.model.layers.0.mlp.bias": torch.zeros(4)}))
    with pytest.raises(CheckpointError, match=r"unknown tensor 'language_model\.model\.layers\.0\.mlp\.bias'"):
        load_checkpoint(config, directory)


def test_loads_transformers_save_pretrained(tmp_path):
    """transformers 5.x saves Kimi Linear with A_log [1, 1, H, 1], everything in the model dtype and
    the dense layer-0 MLP under block_sparse_moe; the loader maps it onto the canonical table."""
    transformers = pytest.importorskip("transformers")
    config = kimi_linear_small()
    hf = transformers.KimiLinearConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, num_local_experts=4, num_experts_per_tok=2, linear_head_dim=32,
        linear_num_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(hf)
    model.save_pretrained(tmp_path / "hf")
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in stored(tmp_path / "hf" / SINGLE_FILE)
    loaded = load_checkpoint(config, tmp_path / "hf")
    sd = model.state_dict()
    p, moe, inter, proj = "model.layers.1", "model.layers.1.mlp.experts", 32, 64
    assert torch.equal(loaded[f"{p}.self_attn.A_log"], sd[f"{p}.self_attn.forget_gate.A_log"].flatten())
    assert torch.equal(loaded[f"{p}.self_attn.k_conv1d.weight"], sd[f"{p}.self_attn.conv1d.weight"][proj : 2 * proj])
    assert torch.equal(loaded["model.layers.0.mlp.down_proj.weight"], sd["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(loaded[f"{p}.block_sparse_moe.experts.w1.weight"], sd[f"{moe}.gate_up_proj"][:, :inter])
    assert torch.equal(loaded[f"{p}.block_sparse_moe.experts.w3.weight"], sd[f"{moe}.gate_up_proj"][:, inter:])
    assert torch.equal(loaded[f"{p}.block_sparse_moe.experts.w2.weight"], sd[f"{moe}.down_proj"])


# --- saving ----------------------------------------------------------------------------------------


def test_interrupted_save_leaves_nothing(kl_checkpoint, tmp_path, monkeypatch):
    config, weights, _ = kl_checkpoint
    calls = []

    def failing_save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        save_file(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(config, weights, tmp_path / "ckpt", max_shard_bytes=40_000, config_json=CONFIG_JSON)
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_to_overwrite_and_needs_json_for_built_configs(kl_checkpoint, tmp_path):
    config, weights, directory = kl_checkpoint
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        save_checkpoint(config, weights, directory, config_json=CONFIG_JSON)
    with pytest.raises(CheckpointError, match="differs from its source .* pass config_json"):
        save_checkpoint(config, weights, tmp_path / "new")
    bad = dict(weights, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight': expected shape \[64\], found \[3\]"):
        save_checkpoint(config, bad, tmp_path / "new", config_json=CONFIG_JSON)


# --- random weights ----------------------------------------------------------------------------------


def test_write_random_checkpoint(tmp_path):
    config = k3_small()
    directory = write_random_checkpoint(config, tmp_path / "ckpt", seed=5, config_json=CONFIG_JSON)
    assert_same(load_checkpoint(config, directory), random_weights(config, seed=5))


def test_random_weights_are_deterministic_per_tensor_and_bf16_exact():
    config = k3_small()
    a = random_weights(config, seed=7)
    assert_same(random_weights(config, seed=7), a)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(random_weights(config, seed=8)[q], a[q])
    # seeded per tensor: a 2-layer slice has the full model's weights for those layers
    sliced = config.replace(num_layers=2, layer_kinds=config.layer_kinds[:2])
    for name, t in random_weights(sliced, seed=7).items():
        assert torch.equal(t, a[name]), name
    for name, t in a.items():
        if t.is_floating_point():
            assert torch.equal(t.to(torch.bfloat16).float(), t), name
    b = random_weights(config, seed=7, dtype=torch.bfloat16)
    assert all(torch.equal(b[n].float(), t.float()) for n, t in a.items())


def test_random_weights_of_a_rank_are_its_pieces():
    from k3mk.passes.tp_shard import weight_split
    from k3mk.runtime.tp import rank_pieces

    config = k3_small()
    full = random_weights(config, seed=3, dtype=torch.bfloat16)
    shards = {n: {"dim": weight_split(n), "parts": 2, "groups": 1} for n in full if weight_split(n) is not None}
    for rank in range(2):
        assert_same(random_weights(config, seed=3, dtype=torch.bfloat16, shards=shards, rank=rank), rank_pieces(full, shards, rank))


class RoutingLog(TorchDispatchMode):
    """Records every router decision and the input RMS of every RMSNorm of the reference step."""

    def __init__(self):
        super().__init__()
        self.margins, self.choices, self.norm_rms = [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.k3mk.router_topk.default:
            logits, bias, k = args[:3]
            top = (torch.sigmoid(logits.float()) + bias.float()).topk(k + 1).values
            self.margins.append(top[:, k - 1] - top[:, k])  # k-th minus (k+1)-th selection score
            self.choices.append(out[0].sort(-1).values)
        elif func is torch.ops.k3mk.rmsnorm.default:
            self.norm_rms.append(args[0].float().pow(2).mean(-1).sqrt())
        return out


@pytest.fixture(scope="module")
def tiny_run(tiny):
    """k3-tiny, 8 decode steps at batch 4 on random tokens."""
    config, weights = tiny
    model = DecodeStep(config)
    model.load_state_dict(weights)
    steps, batch = 8, 4
    state, log, logits = model.new_state(batch, steps), RoutingLog(), []
    g = torch.Generator().manual_seed(1)
    with torch.no_grad(), log:
        for step in range(steps):
            out, state = model(torch.randint(config.vocab_size, (batch,), generator=g), torch.full((batch,), step), state)
            logits.append(out)
    return config, log, torch.stack(logits)


def test_random_weights_route_with_clear_varied_margins(tiny_run):
    """A bf16 step perturbs a router logit by about 1e-2 relative (bf16 activations: a few roundings of
    2^-9 per layer), i.e. <= ~0.06 for logits up to ~6, and a selection score sigmoid(l) + bias by at
    most a quarter of that (sigmoid' <= 1/4): ~1.5e-2 (measured on this run in bf16: 1.1e-3, same
    experts). A 0.1 margin keeps every choice clear of a flip. Measured: min ~0.4, median ~0.45."""
    config, log, _ = tiny_run
    margins = torch.cat(log.margins)
    assert margins.numel() == 8 * 4 * 7  # steps x batch x MoE layers
    assert margins.min() > 0.1
    choices = torch.stack(log.choices).reshape(8, 7, 4, config.moe.top_k)  # [step, layer, batch, k]
    for layer in range(7):
        sets = {tuple(c.tolist()) for c in choices[:, layer].reshape(-1, config.moe.top_k)}
        assert len(sets) >= 2, f"MoE layer {layer}: every token chose {sets}"
        assert len(choices[:, layer].unique()) >= config.moe.num_experts // 2
    assert not torch.equal(choices[:, 0], choices[:, 1])  # layers route differently


def test_random_weights_keep_activations_order_one(tiny_run):
    _, log, logits = tiny_run
    rms = torch.stack(log.norm_rms)  # [norm calls, batch]: residual stream, block mixes, latents, ...
    assert rms.min() > 0.05 and rms.max() < 5.0
    assert torch.isfinite(logits).all() and 0.3 < logits.pow(2).mean().sqrt() < 3.0
