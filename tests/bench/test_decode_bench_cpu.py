"""CPU tests of bench/decode_bench.py: the roofline byte count against an independent count from the
weight and state tables, the artifact choice per (config, batch, context), and the results table."""

from __future__ import annotations

import json

import pytest

from k3mk.bench import decode_bench as bench
from k3mk.compiler.config import load_config
from k3mk.compiler.weights import state_specs, weight_specs

BYTES = {"compute": 2, "float32": 4, "uint8": 1}  # bf16 activations and weights


def independent_step_bytes(config, batch: int, context: int, distinct_per_layer: list[int]) -> float:
    """What one step must move, counted from the tables (DESIGN.md "Benchmark method"): every weight the
    step reads at its stored width, one embedding row per request, each layer's distinct experts once;
    KDA states read and written; the latent cache read over `context` rows, one row per request written."""
    total = 0.0
    per_expert = {}  # layer -> bytes of one expert (w1, w2, w3 with their scales)
    for spec in weight_specs(config):
        nbytes = spec.numel * BYTES[spec.dtype]
        if ".experts." in spec.name:
            layer = int(spec.name.split(".")[2])
            per_expert[layer] = per_expert.get(layer, 0) + nbytes / config.moe.num_experts
        elif spec.name == "model.embed_tokens.weight":
            total += batch * config.hidden_size * 2
        elif spec.name.startswith("model.layers.0.self_attention_res_"):
            continue  # the first layer's mix has no block to mix: never read
        else:
            total += nbytes
    total += sum(per_expert[layer] * n for layer, n in zip(sorted(per_expert), distinct_per_layer))
    for spec in state_specs(config, batch, context):
        nbytes = spec.numel * BYTES[spec.dtype]
        total += nbytes + (batch * config.mla.cache_width * 2 if spec.name.endswith("kv_cache") else nbytes)
    return total


@pytest.mark.parametrize("name,batch,context", [("k3-tiny", 2, 96), ("kimi-linear-tiny", 3, 64)])
def test_roofline_bytes_match_an_independent_count(name, batch, context):
    config = load_config(name)
    terms = bench.roofline_terms(config, batch, context)
    layers = terms["moe_layers"]
    distinct = [min(config.moe.num_experts, batch * config.moe.top_k) - i % 2 for i in range(layers)]  # any per-layer counts
    assert bench.step_bytes(terms, sum(distinct)) == pytest.approx(independent_step_bytes(config, batch, context, distinct), rel=1e-12)
    expected = [terms["expected_distinct_experts"]] * layers  # and the compiler's own expected-routing total
    assert terms["total"] == pytest.approx(independent_step_bytes(config, batch, context, expected), rel=1e-12)


def _manifest(path, **fields):
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"tp": 1, "debug": False, **fields}))


def test_artifact_choice(tmp_path):
    config = load_config("k3-tiny")
    h = config.hash()
    _manifest(tmp_path / "b1_t8192", config_hash=h, max_tokens=1, max_context=8192)
    _manifest(tmp_path / "b1_t32768", config_hash=h, max_tokens=1, max_context=32768)
    _manifest(tmp_path / "b1_t1024_debug", config_hash=h, max_tokens=1, max_context=1024, debug=True)
    _manifest(tmp_path / "b1_t1024_profile", config_hash=h, max_tokens=1, max_context=1024, profile=True)
    _manifest(tmp_path / "other_config", config_hash="0" * 16, max_tokens=1, max_context=1024)
    _manifest(tmp_path / "op_case", max_tokens=1)  # an op-test artifact: no model config
    index = bench.artifact_index(tmp_path)
    assert bench.pick_artifact(index, config, 1, 1024) == (8192, tmp_path / "b1_t8192")
    assert bench.pick_artifact(index, config, 1, 8192) == (8192, tmp_path / "b1_t8192")
    assert bench.pick_artifact(index, config, 1, 8193) == (32768, tmp_path / "b1_t32768")
    assert bench.pick_artifact(index, config, 1, 65536) is None
    assert bench.pick_artifact(index, config, 2, 1024) is None


def test_markdown_rows():
    common = {"model": "k3-tiny", "context": 1024, "roofline_us": 100.0, "baseline_median_us": 250.0, "baseline_p90_us": 260.0,
              "baseline_fraction_of_roofline": 0.4, "distinct_experts": 12.0}  # fmt: skip
    result = {"rows": [
        {**common, "batch": 1, "artifact_max_context": 8192, "megakernel_median_us": 200.0, "megakernel_p90_us": 1210.0,
         "megakernel_fraction_of_roofline": 0.5, "speedup": 1.25, "megakernel_predicted_us": 1234.4},
        {**common, "batch": 2, "artifact_max_context": None},
    ]}  # fmt: skip
    header, rule, with_mk, baseline_only = bench.markdown_rows(result)
    assert header.count("|") == rule.count("|") == with_mk.count("|") == baseline_only.count("|")
    assert "| k3-tiny | 1 | 1024 | 8192 | 200 / 1,210 | 250 / 260 | 100 | 50% | 40% | 1.25x | 12 | 1,234 |" == with_mk
    assert "| k3-tiny | 2 | 1024 | — | — | 250 / 260 | 100 | — | 40% | — | 12 | — |" == baseline_only


def test_clear_mask_needs_more_than_two_bf16_ulps():
    """A gap is clear above 0.05 AND above 2 bf16 ULPs at the top logit (ULP 1/32 on [4, 8), 1/16 on [8, 16))."""
    import torch

    pairs = [(4.78125, 4.71875, False), (4.8125, 4.71875, True), (0.5, 0.46, False), (12.0, 11.875, False),
             (12.0, 11.8125, True), (-3.0, -3.5, True)]  # fmt: skip
    logits = torch.full((len(pairs), 7), -20.0)
    for i, (top, second, _) in enumerate(pairs):
        logits[i, 2], logits[i, 5] = top, second
    assert bench.clear_mask(logits.to(torch.bfloat16)).tolist() == [want for _, _, want in pairs]
