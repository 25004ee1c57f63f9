"""Config parsing: every preset resolves to the numbers of the spec (docs/kimi_k3_decode_spec.md
sections 1.1, 1.2, 11.1; models/README.md), transformers' save_pretrained form parses to the same
config as the published form, and every invalid or unsupported value is a ConfigError that names
the file, the field and the value."""

from __future__ import annotations

import copy
import json
from importlib import resources

import pytest

from k3mk.compiler.config import PRESETS, ConfigError, ModelConfig, load_config, parse_config


def preset_json(name: str) -> dict:
    return json.loads(resources.files("k3mk.compiler").joinpath("presets", f"{name}.json").read_text())


def mla_every_fourth(num_layers: int) -> tuple[int, ...]:
    """0-based MLA layers of the K3 family: 1-based 4, 8, ... plus the last layer."""
    return tuple(sorted({i for i in range(3, num_layers, 4)} | {num_layers - 1}))


# --- presets ---------------------------------------------------------------------------------------


def test_every_preset_parses():
    for name in PRESETS:
        config = load_config(name)
        assert config.name == name
        assert len(config.layer_kinds) == config.num_layers
        assert config.hash() == load_config(name).hash()


def test_kimi_k3():
    c = load_config("kimi-k3")
    assert (c.model_type, c.checkpoint_prefix) == ("kimi_k3", "language_model.")
    assert (c.hidden_size, c.num_layers, c.vocab_size, c.rms_norm_eps) == (7168, 93, 163840, 1e-5)
    assert c.mla_layers == mla_every_fourth(93) == tuple(range(3, 91, 4)) + (91, 92)
    assert len(c.mla_layers) == 24 and len(c.kda_layers) == 69
    assert (c.kda.num_heads, c.kda.head_dim, c.kda.conv_size, c.kda.proj_size) == (96, 128, 4, 12288)
    assert (c.kda.gate_form, c.kda.gate_lower_bound, c.kda.full_rank_output_gate) == ("lower_bound_sigmoid", -5.0, True)
    m = c.mla
    assert (m.num_heads, m.q_lora_rank, m.kv_lora_rank) == (96, 1536, 512)
    assert (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.qk_head_dim, m.cache_width) == (128, 64, 128, 192, 576)
    assert m.output_gate and m.latent_norm_eps == 1e-6
    assert (c.activation, c.situ_beta, c.situ_linear_beta) == ("situ", 4.0, 25.0)
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.intermediate_size) == (896, 16, 2, 3072)
    assert (moe.latent_size, moe.latent_norm, moe.renormalize, moe.routed_scaling_factor) == (3584, True, True, 1.0)
    assert (moe.expert_format, moe.mxfp4_group_size) == ("mxfp4", 32)
    assert (c.attn_res_block_size, c.dense_intermediate_size, c.first_k_dense_replace) == (12, 33792, 1)
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 93))


def test_kimi_linear_48b():
    c = load_config("kimi-linear-48b-a3b")
    assert (c.model_type, c.checkpoint_prefix) == ("kimi_linear", "")
    assert (c.hidden_size, c.num_layers, c.vocab_size) == (2304, 27, 163840)
    assert c.mla_layers == (3, 7, 11, 15, 19, 23, 26) and len(c.kda_layers) == 20
    assert (c.kda.num_heads, c.kda.head_dim, c.kda.conv_size) == (32, 128, 4)
    assert (c.kda.gate_form, c.kda.gate_lower_bound, c.kda.full_rank_output_gate) == ("softplus", None, False)
    m = c.mla
    assert (m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (32, None, 512, 128, 64, 128)
    assert not m.output_gate
    assert c.activation == "silu"
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.intermediate_size) == (256, 8, 1, 1024)
    assert (moe.latent_size, moe.latent_norm, moe.routed_scaling_factor, moe.expert_format) == (None, False, 2.446, "bf16")
    assert (c.attn_res_block_size, c.dense_intermediate_size, c.first_k_dense_replace) == (None, 9216, 1)


def test_kimi_k3_040b_twin():
    c = load_config("kimi-k3-0.40b")
    assert (c.hidden_size, c.num_layers, c.vocab_size, c.dense_intermediate_size) == (1024, 8, 163840, 2048)
    assert c.mla_layers == (3, 7) and c.kda_layers == (0, 1, 2, 4, 5, 6)
    # No gate_lower_bound in this config: the softplus decay gate, with K3's full-rank output gate.
    assert (c.kda.num_heads, c.kda.head_dim, c.kda.gate_form, c.kda.full_rank_output_gate) == (8, 32, "softplus", True)
    m = c.mla
    assert (m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.output_gate) == (8, 256, 128, 64, 32, 64, True)
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.intermediate_size, moe.latent_size) == (8, 2, 1, 256, 512)
    assert (moe.expert_format, c.activation, c.attn_res_block_size) == ("bf16", "situ", 4)


def test_k3_tiny():
    c = load_config("k3-tiny")
    assert (c.hidden_size, c.num_layers, c.vocab_size, c.dense_intermediate_size) == (512, 8, 4096, 1024)
    assert c.mla_layers == (3, 7) and c.kda_layers == (0, 1, 2, 4, 5, 6)
    assert (c.kda.num_heads, c.kda.head_dim, c.kda.conv_size, c.kda.gate_form, c.kda.gate_lower_bound) == (4, 128, 4, "lower_bound_sigmoid", -5.0)
    assert c.kda.full_rank_output_gate
    m = c.mla
    assert (m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.output_gate) == (4, 128, 128, 64, 32, 64, True)
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.intermediate_size, moe.latent_size, moe.latent_norm) == (16, 4, 1, 256, 256, True)
    assert (moe.expert_format, moe.routed_scaling_factor, c.activation, c.attn_res_block_size) == ("mxfp4", 1.0, "situ", 3)


@pytest.mark.parametrize("name, expert_format", [("k3-proxy-16l", "mxfp4"), ("k3-proxy-16l-bf16", "bf16")])
def test_k3_proxies(name, expert_format):
    c = load_config(name)
    assert (c.hidden_size, c.num_layers, c.vocab_size, c.dense_intermediate_size) == (7168, 16, 163840, 33792)
    assert c.mla_layers == (3, 7, 11, 15)
    assert (c.kda.num_heads, c.kda.head_dim, c.kda.gate_form) == (96, 128, "lower_bound_sigmoid")
    m = c.mla
    assert (m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (96, 1536, 512, 128, 64, 128)
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.intermediate_size, moe.latent_size) == (64, 16, 2, 3072, 3584)
    assert (moe.expert_format, c.attn_res_block_size) == (expert_format, 12)


def test_proxies_differ_only_in_expert_format():
    a, b = load_config("k3-proxy-16l"), load_config("k3-proxy-16l-bf16")
    assert a.replace(name="", source="", moe=a.moe.__class__(**{**a.moe.__dict__, "expert_format": "bf16"})) == b.replace(name="", source="")
    assert a.hash() != b.hash()


# --- transformers' save_pretrained form (no transformers needed: the dict is written out here) -----


def transformers_form(published: dict) -> dict:
    """The flat config.json that transformers 5.20's KimiLinearConfig.save_pretrained writes for a model
    built from scratch: per-layer type lists and linear_* fields instead of linear_attn_config, no
    mla_use_nope / first_k_dense_replace / moe_layer_freq / use_grouped_topk."""
    d = copy.deepcopy(published)
    lin = d.pop("linear_attn_config")
    n = d["num_hidden_layers"]
    d["layer_types"] = ["full_attention" if i + 1 in lin["full_attn_layers"] else "linear_attention" for i in range(n)]
    first_k = d.pop("first_k_dense_replace")
    d["mlp_layer_types"] = ["dense" if i < first_k else "sparse" for i in range(n)]
    d.update(linear_num_heads=lin["num_heads"], linear_head_dim=lin["head_dim"], linear_conv_kernel_dim=lin["short_conv_kernel_size"])
    for key in ("mla_use_nope", "moe_layer_freq", "use_grouped_topk"):
        d.pop(key)
    return d


def same_model(a: ModelConfig, b: ModelConfig) -> bool:
    return a.replace(name="", source="") == b.replace(name="", source="")


def test_transformers_form_equals_published_form():
    published = preset_json("kimi-linear-48b-a3b")
    flat = parse_config(transformers_form(published), where="flat/config.json")
    assert same_model(flat, load_config("kimi-linear-48b-a3b"))


def test_both_forms_together_parse_when_they_agree():
    """What transformers writes when it re-saves a published config: the published fields plus its own."""
    published = preset_json("kimi-linear-48b-a3b")
    both = {**transformers_form(published), **published}
    assert same_model(parse_config(both, where="resaved/config.json"), load_config("kimi-linear-48b-a3b"))


def test_alias_field_names():
    d = transformers_form(preset_json("kimi-linear-48b-a3b"))
    for alias, canonical in (
        ("num_local_experts", "num_experts"),
        ("num_experts_per_tok", "num_experts_per_token"),
        ("n_shared_experts", "num_shared_experts"),
        ("norm_topk_prob", "moe_renormalize"),
        ("n_group", "num_expert_group"),
    ):
        d[alias] = d.pop(canonical)
    assert same_model(parse_config(d, where="aliases/config.json"), load_config("kimi-linear-48b-a3b"))


def test_transformers_save_pretrained_round_trip(tmp_path):
    """The real thing: transformers' KimiLinearConfig reads the published config and re-saves it; a
    config built from scratch with alias keyword names saves and parses too."""
    transformers = pytest.importorskip("transformers")
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text(json.dumps(preset_json("kimi-linear-48b-a3b")))
    transformers.KimiLinearConfig.from_pretrained(published).save_pretrained(tmp_path / "resaved")
    assert same_model(load_config(tmp_path / "resaved"), load_config("kimi-linear-48b-a3b"))

    fresh = transformers.KimiLinearConfig(
        vocab_size=97, hidden_size=40, intermediate_size=56, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=3, num_key_value_heads=3, q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, num_local_experts=5, num_experts_per_tok=2, n_shared_experts=2,
        norm_topk_prob=False, routed_scaling_factor=1.5, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"], mlp_layer_types=["dense", "dense", "sparse"],
    )  # fmt: skip
    fresh.save_pretrained(tmp_path / "fresh")
    c = load_config(tmp_path / "fresh")
    assert c.layer_kinds == ("kda", "mla", "kda") and c.first_k_dense_replace == 2
    assert (c.kda.num_heads, c.kda.head_dim, c.kda.conv_size, c.kda.gate_form) == (2, 8, 3, "softplus")
    assert (c.mla.q_lora_rank, c.mla.output_gate, c.activation, c.attn_res_block_size) == (20, False, "silu", None)
    assert (c.moe.num_experts, c.moe.top_k, c.moe.num_shared_experts, c.moe.renormalize, c.moe.routed_scaling_factor) == (5, 2, 2, False, 1.5)


# --- errors ----------------------------------------------------------------------------------------


def k3_tiny(**text_changes) -> dict:
    d = preset_json("k3-tiny")
    d["text_config"].update(text_changes)
    return d


def check_error(data: dict, *fragments: str) -> None:
    """Parsing must fail with one message that names the file and contains every fragment."""
    with pytest.raises(ConfigError) as info:
        parse_config(data, where="some/dir/config.json")
    message = str(info.value)
    for fragment in ("some/dir/config.json",) + fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_missing_field():
    d = k3_tiny()
    del d["text_config"]["hidden_size"]
    check_error(d, "'text_config.hidden_size'", "missing")
    d = k3_tiny()
    del d["text_config"]["linear_attn_config"]["num_heads"]
    check_error(d, "'text_config.linear_attn_config.num_heads'", "missing")
    d = k3_tiny()
    del d["text_config"]["mla_use_nope"]  # required where linear_attn_config is (the published form)
    check_error(d, "'text_config.mla_use_nope'", "missing")
    d = k3_tiny()
    del d["text_config"]["first_k_dense_replace"]
    check_error(d, "'text_config.first_k_dense_replace'", "missing")
    check_error({"hidden_size": 8}, "'model_type'", "missing")


def test_wrong_type():
    check_error(k3_tiny(hidden_size="512"), "'text_config.hidden_size'", "integer", "'512'")
    check_error(k3_tiny(num_experts=16.0), "'text_config.num_experts'", "integer", "16.0")
    check_error(k3_tiny(mla_use_output_gate="yes"), "'text_config.mla_use_output_gate'", "true or false", "'yes'")
    check_error(k3_tiny(rms_norm_eps="1e-5"), "'text_config.rms_norm_eps'", "number", "'1e-5'")
    check_error(k3_tiny(linear_attn_config=[1, 2]), "'text_config.linear_attn_config'", "object")
    d = k3_tiny()
    d["text_config"]["linear_attn_config"]["kda_layers"] = "1,2,3"
    check_error(d, "'text_config.linear_attn_config.kda_layers'", "'1,2,3'")


def test_unsupported_values():
    check_error(k3_tiny(mla_use_nope=False), "'text_config.mla_use_nope'", "false", "NoPE")
    check_error(k3_tiny(hidden_act="gelu"), "'text_config.hidden_act'", "'gelu'")
    check_error(k3_tiny(model_type="deepseek_v3"), "'text_config.model_type'", "'deepseek_v3'")
    check_error({**preset_json("k3-tiny"), "model_type": "llama"}, "'model_type'", "'llama'")
    check_error(k3_tiny(tie_word_embeddings=True), "'text_config.tie_word_embeddings'", "true")
    check_error(k3_tiny(num_nextn_predict_layers=1), "'text_config.num_nextn_predict_layers'")
    check_error(k3_tiny(num_key_value_heads=2), "'text_config.num_key_value_heads'", "found 2")
    check_error(k3_tiny(num_expert_group=2), "'text_config.num_expert_group'", "2")
    check_error(k3_tiny(topk_method="greedy"), "'text_config.topk_method'", "'greedy'")
    check_error(k3_tiny(moe_router_activation_func="softmax"), "'text_config.moe_router_activation_func'", "'softmax'")
    check_error(k3_tiny(num_experts_per_token=17), "'text_config.num_experts_per_token'", "17")
    check_error(k3_tiny(attention_bias=True), "'text_config.attention_bias'", "true")
    d = k3_tiny()
    d["text_config"]["linear_attn_config"]["gate_lower_bound"] = 1.0
    check_error(d, "'text_config.linear_attn_config.gate_lower_bound'", "1.0")


def test_layer_schedule_errors():
    d = k3_tiny()
    d["text_config"]["linear_attn_config"]["full_attn_layers"] = [3, 4, 8]
    check_error(d, "'text_config.linear_attn_config.full_attn_layers'", "layer 3", "both")
    d = k3_tiny()
    d["text_config"]["linear_attn_config"]["full_attn_layers"] = [8]
    check_error(d, "'text_config.linear_attn_config.kda_layers'", "[4]", "neither")
    d = k3_tiny()
    d["text_config"]["linear_attn_config"]["full_attn_layers"] = [0, 4, 8]  # the lists are 1-based
    check_error(d, "'text_config.linear_attn_config.full_attn_layers'", "layer 0", "1-based")


def test_quantization_errors():
    d = k3_tiny()
    q = d["text_config"]["quantization_config"]
    q["ignore"] = [p for p in q["ignore"] if "self_attn" not in p]
    check_error(d, "'text_config.quantization_config.ignore'", "quantize", "self_attn")
    d = k3_tiny()
    d["text_config"]["quantization_config"]["ignore"].append("re:.*experts.*")
    check_error(d, "'text_config.quantization_config.ignore'", "experts.0.w1")
    d = k3_tiny()
    d["text_config"]["quantization_config"]["format"] = "nvfp4-pack-quantized"
    check_error(d, "'text_config.quantization_config.format'", "'nvfp4-pack-quantized'")
    d = k3_tiny()
    d["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    check_error(d, "'text_config.quantization_config.config_groups.group_0.weights.group_size'", "16")


def flat(**changes) -> dict:
    d = transformers_form(preset_json("kimi-linear-48b-a3b"))
    d.update(changes)
    return d


def test_transformers_form_errors():
    layer_types = flat()["layer_types"]
    check_error(flat(layer_types=layer_types[:-1]), "'layer_types'", "27 entries")
    check_error(flat(layer_types=["sliding_attention"] + layer_types[1:]), "'layer_types'", "entry 0", "'sliding_attention'")
    check_error(flat(mlp_layer_types=["sparse", "dense"] + ["sparse"] * 25), "'mlp_layer_types'", "entry 1", "'dense'")
    check_error(flat(mlp_layer_types=["dense", "moe"] + ["sparse"] * 25), "'mlp_layer_types'", "'moe'")
    d = flat()
    del d["linear_num_heads"]
    check_error(d, "'linear_num_heads'", "missing")
    d = flat()
    del d["layer_types"]
    check_error(d, "'layer_types'", "missing")
    check_error(flat(num_local_experts=128), "'num_local_experts'", "128", "'num_experts'", "256")


def test_forms_that_disagree():
    published = preset_json("kimi-linear-48b-a3b")
    both = {**transformers_form(published), **published}
    check_error({**both, "linear_num_heads": 16}, "'linear_num_heads'", "16", "linear_attn_config.num_heads is 32")
    swapped = list(both["layer_types"])
    swapped[0], swapped[3] = swapped[3], swapped[0]
    check_error({**both, "layer_types": swapped}, "'layer_types'", "entry 0", "'full_attention'", "layer 1")
    check_error({**both, "first_k_dense_replace": 2}, "'mlp_layer_types'", "entry 1", "first_k_dense_replace=2")


def test_load_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="neither a preset"):
        load_config(tmp_path / "absent")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(k3_tiny(hidden_act="gelu")))
    with pytest.raises(ConfigError, match=r"config\.json: field 'text_config\.hidden_act'.*'gelu'"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("rms_norm_eps", -1, "a number > 0"),
        ("rms_norm_eps", 0, "a number > 0"),
        ("rms_norm_eps", float("nan"), "a finite number"),
        ("rms_norm_eps", float("inf"), "a finite number"),
        ("routed_scaling_factor", -2.5, "a number > 0"),
        ("routed_scaling_factor", float("nan"), "a finite number"),
        ("activation_situ_beta", 0.0, "a number > 0"),
        ("activation_situ_linear_beta", float("-inf"), "a finite number"),
    ],
)
def test_non_finite_and_out_of_range_numbers(field, value, expected):
    """JSON admits NaN and Infinity (Python writes and reads them); a config with them, or with a
    non-positive epsilon or scale, would make every logit NaN: refused, naming the field."""
    text = json.dumps(k3_tiny(**{field: value}))  # through JSON text, as from a file
    check_error(json.loads(text), f"'text_config.{field}'", expected)
    d = k3_tiny()
    d["text_config"]["linear_attn_config"]["gate_lower_bound"] = float("nan")
    check_error(json.loads(json.dumps(d)), "'text_config.linear_attn_config.gate_lower_bound'", "a finite number")


def test_the_models_own_context_limit():
    assert load_config("kimi-k3").max_context == 1048576 and load_config("k3-tiny").max_context == 4096
    assert load_config("kimi-linear-48b-a3b").max_context == 1048576  # model_max_length, transformers' name
    d = preset_json("kimi-linear-tiny")
    d["max_position_embeddings"] = 2048  # the alias, disagreeing with model_max_length 4096
    check_error(d, "'max_position_embeddings'", "2048", "'model_max_length'", "4096")
    d = k3_tiny()
    del d["text_config"]["max_position_embeddings"]
    c = parse_config(d)
    assert c.max_context is None and c.hash() == load_config("k3-tiny").hash()  # not part of the compiled step


def test_transformers_linear_attn_config_without_mla_use_nope(tmp_path):
    """transformers' KimiLinearConfig built from a `linear_attn_config` dict saves that dict and no
    `mla_use_nope` (its MLA is always NoPE): it parses, to the same model as the explicit form."""
    transformers = pytest.importorskip("transformers")
    lin = {"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4], "full_attn_layers": [3]}
    hf = transformers.KimiLinearConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=384, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, num_local_experts=8, num_experts_per_tok=2, linear_attn_config=lin,
    )  # fmt: skip
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "linear_attn_config" in saved and "mla_use_nope" not in saved
    c = load_config(tmp_path)
    assert c.layer_kinds == ("kda", "kda", "mla", "kda") and (c.kda.num_heads, c.kda.head_dim) == (4, 64)
    assert same_model(c, parse_config({**saved, "mla_use_nope": True}))
    check_error({**saved, "mla_use_nope": False}, "'mla_use_nope'", "false", "NoPE")
