"""The compile target's limits (compiler/limits.py) are stated and refused before the pipeline runs:
tokens per step, context (with the decode state per rank), kernel shapes through codegen's own checks.
Each refusal must come in well under the seconds a capture takes."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from importlib import resources

import pytest
import torch

from k3mk.codegen.ops import MAX_BATCH
from k3mk.compiler import limits
from k3mk.compiler.config import load_config
from k3mk.compiler.limits import CompileError, check_kernel_shapes, kernel_records, state_size
from k3mk.compiler.pipeline import compile_artifact, compile_graph
from k3mk.compiler.weights import state_specs


def refused_fast(config, match: str, **target) -> None:
    start = time.perf_counter()
    with pytest.raises(CompileError, match=match):
        compile_graph(config, **target)
    assert time.perf_counter() - start < 2.0, "refused only after the pipeline ran"


@pytest.mark.parametrize("tokens", [MAX_BATCH + 1, 2048, 10000])
def test_tokens_per_step_beyond_the_maximum(tokens):
    refused_fast(load_config("k3-tiny"), rf"--max-tokens {tokens}: the megakernel runs 1 to {MAX_BATCH} tokens per step", max_tokens=tokens)


def test_context_beyond_the_models_maximum():
    refused_fast(load_config("k3-tiny"), r"--max-context 4097: supported 1 to 4096 \(the model's maximum", max_context=4097)


def test_context_beyond_any_gpu_prints_the_state():
    """kimi-k3 at TP8, 16 tokens per step, its full 1M context: the dense latent cache alone is 464 GB on
    every rank (24 MLA layers x 16 x 1,048,576 positions x (512 + 64) bf16, replicated), more than a B200's."""
    config = load_config("kimi-k3")
    want = state_size(config, 8, 16, 1_048_576)
    assert want.mla == 24 * 16 * 1_048_576 * 576 * 2
    match = rf"--max-context 1048576: the decode state needs {want.total / 1e9:.2f} GB .* per rank at --max-tokens 16 --tp 8, more than the 186.00 GB of the largest sm_100a GPU"
    refused_fast(config, match, tp=8, max_tokens=16, max_context=1_048_576, arch="sm_100a")
    limits.check_context(config, 8, 8, 1_048_576, "sm_103a")  # 8 tokens per step: 232 GB, within a B300's 288 GB
    stated_none = config.replace(max_context=None)  # a config that states no maximum: int32 positions bound it
    refused_fast(stated_none, r"--max-context 3000000000: supported 1 to 2147483647 \(int32 positions\)", max_context=3_000_000_000)


def test_state_size_is_the_states_of_one_rank():
    """Against the state tensors themselves: KDA states split over the ranks, the latent cache whole."""
    config = load_config("k3-tiny")
    rng = random.Random(3)
    for tp in (1, 2, 4):
        batch, context = rng.randint(1, MAX_BATCH), rng.randint(1, 4096)
        got = state_size(config, tp, batch, context)
        specs = state_specs(config, batch, context)
        mla = sum(s.numel * 2 for s in specs if s.name.endswith("kv_cache"))
        kda = sum(s.numel * (4 if s.dtype == "float32" else 2) for s in specs if not s.name.endswith("kv_cache")) // tp
        assert (got.kda, got.mla) == (kda, mla)


def _preset(name: str) -> dict:
    return json.loads(resources.files("k3mk.compiler").joinpath("presets", f"{name}.json").read_text())


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: d.update(hidden_size=513), r"hidden_size: embedding dim 513 not a multiple of 8"),
        (lambda d: d["linear_attn_config"].update(head_dim=100), r"the KDA head_dim: kda_recurrence head_dim 100 not in \(64, 128, 256\)"),
        (lambda d: d["linear_attn_config"].update(short_conv_kernel_size=9), r"the KDA short_conv_kernel_size .*: kda_conv width 9 outside \[2, 8\]"),
        (lambda d: d.update(kv_lora_rank=60), r"kv_lora_rank and qk_rope_head_dim: mla_latent: kv_lora_rank 60 and rope 16"),
        (lambda d: d.update(num_experts=1056, num_experts_per_token=2), r"num_experts and num_experts_per_token: router_topk: 1056 experts > 1024"),
    ],
)
def test_kernel_shapes_are_checked_before_the_pipeline(tmp_path, change, match):
    d = _preset("kimi-linear-tiny")
    change(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    config = load_config(tmp_path)
    start = time.perf_counter()
    with pytest.raises(CompileError, match=rf"{tmp_path / 'config.json'}: {match}"):
        compile_artifact(config, max_context=64, out_dir=tmp_path / "art")
    assert time.perf_counter() - start < 2.0 and not (tmp_path / "art").exists()


def test_tp_dependent_shapes_name_the_degree():
    """The experts' intermediate width is split over the ranks: 64 over 16 ranks leaves 4 per rank, not a
    multiple of the 8 a bf16 expert GEMV needs."""
    config = load_config("kimi-linear-tiny")
    config = config.replace(kda=dataclasses.replace(config.kda, num_heads=16), mla=dataclasses.replace(config.mla, num_heads=16))
    check_kernel_shapes(config, 8, 1, 64)  # 8 per rank: fine
    with pytest.raises(CompileError, match=r"moe_intermediate_size at --tp 16: expert_combine in_features 4 not a multiple of 8 \(bfloat16\)"):
        check_kernel_shapes(config, 16, 1, 64)


def test_kernel_records_are_what_the_pipeline_emits():
    """Each record the preflight checks is one the pipeline's emit_task_table produces for that target
    (the router's top-k half: the fused router's fields), for both families, tp 1 and 2, batch 1 and 3."""
    for name, tp, batch in (("k3-tiny", 2, 3), ("kimi-linear-tiny", 1, 1)):
        config = load_config(name)
        emitted = compile_graph(config, tp, batch, 64, torch.bfloat16, "sm_90a").output.table.variants
        for _, record in kernel_records(config, tp, batch, 64):
            if record.op == "router_topk":
                fused = [dataclasses.asdict(v.params) for v in emitted if v.op in ("router", "router_topk")]
                assert all({k: f[k] for k in dataclasses.asdict(record.params)} == dataclasses.asdict(record.params) for f in fused) and fused
            elif record.op == "kda_recurrence":  # value_rows follows the SMs the tile pass spreads a head's rows over
                assert record in [dataclasses.replace(v, params=dataclasses.replace(v.params, value_rows=0)) for v in emitted if v.op == record.op], record
            else:
                assert record in emitted, (name, record, [v for v in emitted if v.op == record.op])


def test_the_presets_the_templates_generate():
    for name, tp in (("kimi-k3", 8), ("kimi-k3", 16), ("kimi-linear-48b-a3b", 1), ("k3-proxy-16l", 1), ("k3-proxy-16l-bf16", 2)):
        config = load_config(name)
        check_kernel_shapes(config, tp, MAX_BATCH, 4096)
        limits.check_context(config, tp, 1, 4096, "sm_90a")
    # the K3 twin's KDA head_dim of 32 has no recurrence template: its analysis runs, its build is refused
    with pytest.raises(CompileError, match=r"preset 'kimi-k3-0.40b': the KDA head_dim: kda_recurrence head_dim 32 not in \(64, 128, 256\)"):
        check_kernel_shapes(load_config("kimi-k3-0.40b"), 1, 1, 4096)
