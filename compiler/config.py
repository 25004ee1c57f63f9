"""Model configs: parse HF `config.json` files of Kimi K3 (`kimi_k3` with a nested `text_config`) and
Kimi Linear (flat `kimi_linear`, including the form transformers' `save_pretrained` writes) into one
typed, validated `ModelConfig`.

Every field the decode step uses is resolved here, once, so nothing downstream reads raw JSON.
Spec references: docs/kimi_k3_decode_spec.md sections 1 (fields), 3 (KDA), 4 (MLA), 5 (FFN), 6 (AttnRes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

PRESETS = ("kimi-k3", "kimi-k3-0.40b", "kimi-linear-48b-a3b", "k3-tiny", "kimi-linear-tiny", "k3-proxy-16l", "k3-proxy-16l-bf16")


class ConfigError(ValueError):
    """An invalid or unsupported model config. The message names the file, the field and the value."""


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int
    conv_size: int
    # "lower_bound_sigmoid": K3, g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
    # "softplus": Kimi Linear, g = -exp(A_log) * softplus(f + dt_bias)          (spec 3.2)
    gate_form: Literal["lower_bound_sigmoid", "softplus"]
    gate_lower_bound: float | None
    full_rank_output_gate: bool  # K3 g_proj [P, d]; else low-rank g_a_proj [D, d] -> g_b_proj [P, D]

    @property
    def proj_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None  # None: plain q_proj (Kimi Linear)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool  # K3: o *= sigmoid(g_proj(x)) before o_proj
    latent_norm_eps: float  # q_a / kv_a layernorms: the reference's class default 1e-6 (spec 4.2, open question 1)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    num_shared_experts: int
    intermediate_size: int  # per routed expert; the shared expert is num_shared_experts times as wide
    latent_size: int | None  # LatentMoE: routed experts run in this width (K3); None: on hidden (Kimi Linear)
    latent_norm: bool
    renormalize: bool
    routed_scaling_factor: float
    expert_format: Literal["bf16", "mxfp4"]  # routed expert weights as stored
    mxfp4_group_size: int  # inputs per UE8M0 scale (32)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    model_type: Literal["kimi_k3", "kimi_linear"]  # the top-level wrapper; decides checkpoint prefixes
    hidden_size: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    layer_kinds: tuple[str, ...]  # per 0-based layer: "kda" or "mla"
    first_k_dense_replace: int
    moe_layer_freq: int
    dense_intermediate_size: int
    activation: Literal["situ", "silu"]  # SiTU-GLU (K3) or SwiGLU (Kimi Linear), spec 5.1
    situ_beta: float
    situ_linear_beta: float | None
    attn_res_block_size: int | None  # block attention residuals (K3, spec 6); None: classic residual
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    max_context: int | None = None  # the longest context the model supports (max_position_embeddings); None: not stated
    source: str = ""  # where it was read from, for error messages

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "mla")

    @property
    def checkpoint_prefix(self) -> str:
        """Prefix of the text model's tensor names in the published checkpoints (models/TENSORS.md)."""
        return "language_model." if self.model_type == "kimi_k3" else ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Content hash of everything that shapes the compiled decode step (not the name, the source or the
        model's maximum context: a compile chooses its own)."""
        d = self.to_dict()
        for key in ("name", "source", "max_context"):
            d.pop(key)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


class _Fields:
    """Typed access to one JSON object with errors that name the file and the field."""

    def __init__(self, data: dict[str, Any], where: str, path: str = ""):
        self.data, self.where, self.path = data, where, path

    def _name(self, key: str) -> str:
        return f"{self.path}{key}"

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: field '{self._name(key)}': {message}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = ...) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise self.error(key, "is missing")
            return default
        return self.data[key]

    def int(self, key: str, default: Any = ..., minimum: int = 1) -> int:
        v = self.raw(key, default)
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(key, f"expected an integer, found {v!r}")
        if v < minimum:
            raise self.error(key, f"expected an integer >= {minimum}, found {v}")
        return v

    def float(self, key: str, default: Any = ..., positive: bool = False) -> float:
        """A finite number (JSON admits NaN and Infinity; no field of these configs means them), > 0 with `positive`."""
        v = self.raw(key, default)
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.error(key, f"expected a finite number, found {v!r}")
        if positive and v <= 0:
            raise self.error(key, f"expected a number > 0, found {v!r}")
        return float(v)

    def bool(self, key: str, default: Any = ...) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise self.error(key, f"expected true or false, found {v!r}")
        return v

    def str(self, key: str, default: Any = ...) -> str:
        v = self.raw(key, default)
        if not isinstance(v, str):
            raise self.error(key, f"expected a string, found {v!r}")
        return v

    def obj(self, key: str) -> "_Fields":
        v = self.raw(key)
        if not isinstance(v, dict):
            raise self.error(key, f"expected an object, found {type(v).__name__}")
        return _Fields(v, self.where, f"{self._name(key)}.")

    def expect(self, key: str, allowed: tuple, default: Any = ...) -> Any:
        v = self.raw(key, default)
        if v not in allowed:
            raise self.error(key, f"unsupported value {v!r} (supported: {', '.join(map(repr, allowed))})")
        return v


# transformers' `KimiLinearConfig.attribute_map`: a hand-written config may spell these fields by the
# alias (transformers accepts both; its `save_pretrained` writes the canonical name on the right).
_ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "max_position_embeddings": "model_max_length",
}


def _fold_aliases(text: _Fields) -> _Fields:
    """Rename alias fields to their canonical names; an alias that contradicts its canonical field is an error."""
    data = dict(text.data)
    for alias, canonical in _ALIASES.items():
        if data.get(alias) is None:
            continue
        if data.get(canonical) is not None and data[canonical] != data[alias]:
            raise text.error(alias, f"is {data[alias]!r} but '{text._name(canonical)}' is {data[canonical]!r} (they are aliases)")
        data[canonical] = data.pop(alias)
    return _Fields(data, text.where, text.path)


def _kda_field(text: _Fields, lin: _Fields | None, key: str, flat_key: str) -> int:
    """A KDA dimension: `linear_attn_config.<key>` (published form) or `<flat_key>` (transformers'
    save_pretrained form: `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`); both must agree."""
    nested = lin.int(key) if lin is not None and lin.has(key) else None
    flat = text.int(flat_key) if text.has(flat_key) else None
    if nested is None and flat is None:
        if lin is not None:
            raise lin.error(key, f"is missing (and there is no top-level '{flat_key}' either)")
        raise text.error(flat_key, "is missing (and there is no linear_attn_config either)")
    if nested is not None and flat is not None and nested != flat:
        raise text.error(flat_key, f"is {flat} but linear_attn_config.{key} is {nested}")
    return nested if nested is not None else flat  # type: ignore[return-value]


def _kinds_from_lists(lin: _Fields, num_layers: int) -> tuple[str, ...]:
    """The 1-based `kda_layers` / `full_attn_layers` lists of `linear_attn_config` (published form)."""
    kinds: list[str | None] = [None] * num_layers
    for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
        values = lin.raw(key, [])
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise lin.error(key, f"expected a list of 1-based layer numbers, found {values!r}")
        for v in values:
            if not 1 <= v <= num_layers:
                raise lin.error(key, f"layer {v} is outside 1..num_hidden_layers={num_layers} (the list is 1-based)")
            if kinds[v - 1] is not None:
                raise lin.error(key, f"layer {v} is listed in both kda_layers and full_attn_layers")
            kinds[v - 1] = kind
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise lin.error("kda_layers", f"layers {missing} (1-based) are in neither kda_layers nor full_attn_layers")
    return tuple(kinds)  # type: ignore[arg-type]


def _per_layer_names(text: _Fields, key: str, num_layers: int, names: dict[str, str]) -> tuple[str, ...]:
    """A per-layer list of type names (transformers' `layer_types` / `mlp_layer_types`), mapped through `names`."""
    values = text.raw(key)
    if not isinstance(values, list) or len(values) != num_layers:
        raise text.error(key, f"expected a list of {num_layers} entries (one per layer), found {values!r}")
    for i, v in enumerate(values):
        if v not in names:
            raise text.error(key, f"entry {i} is {v!r} (supported: {', '.join(map(repr, names))})")
    return tuple(names[v] for v in values)


def _layer_kinds(text: _Fields, lin: _Fields | None, num_layers: int) -> tuple[str, ...]:
    """Resolve the KDA/MLA schedule (0-based): the 1-based lists in `linear_attn_config` (published
    form) and/or `layer_types` (transformers' save_pretrained form). Where both exist they must agree."""
    from_lists = None
    if lin is not None and (lin.has("kda_layers") or lin.has("full_attn_layers")):
        from_lists = _kinds_from_lists(lin, num_layers)
    from_types = None
    if text.has("layer_types"):
        from_types = _per_layer_names(text, "layer_types", num_layers, {"linear_attention": "kda", "full_attention": "mla"})
    if from_lists is None and from_types is None:
        raise text.error("layer_types", "is missing (and there are no linear_attn_config.kda_layers / full_attn_layers either)")
    if from_lists is not None and from_types is not None and from_lists != from_types:
        first = next(i for i, (a, b) in enumerate(zip(from_lists, from_types)) if a != b)
        raise text.error(
            "layer_types",
            f"entry {first} is {text.raw('layer_types')[first]!r} but linear_attn_config lists layer {first + 1} (1-based) as {from_lists[first]}",
        )
    return from_lists if from_lists is not None else from_types  # type: ignore[return-value]


def _dense_layout(text: _Fields, num_layers: int) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq): from those fields (published form) and/or from
    `mlp_layer_types` (transformers' form, "dense"/"sparse" per layer). Where both exist they must agree."""
    first_k = text.int("first_k_dense_replace", None, minimum=0)
    freq = text.int("moe_layer_freq", 1)
    if first_k is not None and first_k > num_layers:
        raise text.error("first_k_dense_replace", f"{first_k} exceeds num_hidden_layers={num_layers}")
    if not text.has("mlp_layer_types"):
        if first_k is None:
            raise text.error("first_k_dense_replace", "is missing (and there is no mlp_layer_types list either)")
        return first_k, freq
    kinds = _per_layer_names(text, "mlp_layer_types", num_layers, {"dense": "dense", "sparse": "sparse"})
    if first_k is None:
        # transformers ignores moe_layer_freq; what our two numbers express without it is: dense
        # layers first, then only MoE ("sparse") layers.
        first_k = kinds.index("sparse") if "sparse" in kinds else num_layers
        freq = 1
    expected = tuple("sparse" if i >= first_k and i % freq == 0 else "dense" for i in range(num_layers))
    if kinds != expected:
        first = next(i for i, (a, b) in enumerate(zip(kinds, expected)) if a != b)
        detail = (
            f"but first_k_dense_replace={text.raw('first_k_dense_replace')} and moe_layer_freq={freq} make it {expected[first]!r}"
            if text.has("first_k_dense_replace")
            else "(supported: dense layers first, then only sparse layers)"
        )
        raise text.error("mlp_layer_types", f"entry {first} is {kinds[first]!r} {detail}")
    return first_k, freq


_MXFP4_IGNORED_MODULES = ("self_attn", "shared_experts", "mlp.gate_proj", "lm_head", "block_sparse_moe.gate")


def _expert_format(text: _Fields) -> tuple[str, int]:
    """Routed-expert weight format from `quantization_config` (compressed-tensors). Only MXFP4 on routed
    experts is supported: everything else in K3 stays BF16 (spec 1.1, 5.5)."""
    if not text.has("quantization_config"):
        return "bf16", 32
    q = text.obj("quantization_config")
    q.expect("quant_method", ("compressed-tensors",))
    fmt = q.expect("format", ("mxfp4-pack-quantized",))
    groups = q.obj("config_groups")
    if len(groups.data) != 1:
        raise groups.error("", f"expected exactly one quantization group, found {len(groups.data)}")
    (gname,) = groups.data
    g = groups.obj(gname)
    g.expect("format", (fmt,), fmt)
    w = g.obj("weights")
    w.expect("num_bits", (4,))
    w.expect("type", ("float",))
    w.expect("strategy", ("group",))
    group_size = w.int("group_size")
    if group_size != 32:
        raise w.error("group_size", f"MXFP4 needs group_size 32, found {group_size}")
    for act in ("input_activations", "output_activations"):
        if g.has(act):
            raise g.error(act, "activation quantization is not supported (expected null)")
    # The ignore list must leave exactly the routed experts quantized.
    ignore = q.raw("ignore", [])
    if not isinstance(ignore, list):
        raise q.error("ignore", f"expected a list, found {ignore!r}")
    probes = {
        "model.layers.1.self_attn.q_proj": True,
        "model.layers.1.block_sparse_moe.shared_experts.up_proj": True,
        "model.layers.0.mlp.gate_proj": True,
        "lm_head": True,
        "model.layers.1.block_sparse_moe.experts.0.w1": False,
    }
    for module, should_ignore in probes.items():
        hit = any(
            (re.fullmatch(p[3:], module) is not None) if p.startswith("re:") else p == module for p in ignore
        )
        if hit != should_ignore:
            raise q.error(
                "ignore",
                f"would {'quantize' if not hit else 'leave unquantized'} '{module}'; only routed experts may be MXFP4",
            )
    return "mxfp4", group_size


def parse_config(data: dict[str, Any], where: str = "<config>", name: str = "") -> ModelConfig:
    """Parse one HF config.json dict. `where` names the file in errors."""
    top = _Fields(data, where)
    model_type = top.expect("model_type", ("kimi_k3", "kimi_linear"))
    text = top.obj("text_config") if model_type == "kimi_k3" else top
    if model_type == "kimi_k3":
        text.expect("model_type", ("kimi_linear",), "kimi_linear")
    text = _fold_aliases(text)
    # transformers' KimiLinearConfig writes the KDA fields flat and only keeps `linear_attn_config`
    # when it read one (a re-saved published config); the published configs always have it.
    lin = text.obj("linear_attn_config") if text.has("linear_attn_config") else None

    num_layers = text.int("num_hidden_layers")
    hidden = text.int("hidden_size")
    kinds = _layer_kinds(text, lin, num_layers)
    first_k_dense, moe_freq = _dense_layout(text, num_layers)

    if text.bool("tie_word_embeddings", False) or top.bool("tie_word_embeddings", False):
        raise text.error("tie_word_embeddings", "true is not supported (Kimi checkpoints have an untied lm_head)")
    if text.int("num_nextn_predict_layers", 0, minimum=0):
        raise text.error("num_nextn_predict_layers", "MTP layers are not supported (expected 0)")

    # K3's lower-bounded gate and full-rank output gate exist only in `linear_attn_config`; transformers'
    # Kimi Linear implements the softplus gate and the low-rank output gate, which are the defaults.
    lower_bound = lin.float("gate_lower_bound", None) if lin is not None else None
    if lower_bound is not None and lower_bound >= 0:
        raise lin.error("gate_lower_bound", f"must be negative, found {lower_bound}")  # type: ignore[union-attr]
    kda = KDAConfig(
        num_heads=_kda_field(text, lin, "num_heads", "linear_num_heads"),
        head_dim=_kda_field(text, lin, "head_dim", "linear_head_dim"),
        conv_size=_kda_field(text, lin, "short_conv_kernel_size", "linear_conv_kernel_dim"),
        gate_form="lower_bound_sigmoid" if lower_bound is not None else "softplus",
        gate_lower_bound=lower_bound,
        full_rank_output_gate=lin.bool("use_full_rank_gate", False) if lin is not None else False,
    )

    # transformers' KimiLinearAttention (model_type kimi_linear) is always NoPE and its config has no
    # `mla_use_nope` (its save_pretrained writes none, with or without `linear_attn_config`): absent means
    # true there. A kimi_k3 config is read by the published remote code, whose default is RoPE: it must say.
    if not text.bool("mla_use_nope", ... if model_type == "kimi_k3" else True):
        raise text.error("mla_use_nope", "false is not supported (only NoPE MLA is implemented; expected true)")
    if text.bool("attention_bias", False):
        raise text.error("attention_bias", "true is not supported (Kimi MLA projections have no bias)")
    mla_heads = text.int("num_attention_heads")
    kv_heads = text.int("num_key_value_heads", mla_heads)
    if kv_heads != mla_heads:
        raise text.error("num_key_value_heads", f"expected {mla_heads} (= num_attention_heads), found {kv_heads}")
    mla = MLAConfig(
        num_heads=mla_heads,
        q_lora_rank=text.int("q_lora_rank", None),
        kv_lora_rank=text.int("kv_lora_rank"),
        qk_nope_head_dim=text.int("qk_nope_head_dim"),
        qk_rope_head_dim=text.int("qk_rope_head_dim"),
        v_head_dim=text.int("v_head_dim"),
        output_gate=text.bool("mla_use_output_gate", False),
        latent_norm_eps=1e-6,
    )

    act = text.expect("hidden_act", ("situ", "silu"))
    text.expect("moe_router_activation_func", ("sigmoid",), "sigmoid")
    text.expect("topk_method", ("noaux_tc",), "noaux_tc")
    # transformers' router always runs the grouped selection (it has no use_grouped_topk switch).
    if text.bool("use_grouped_topk", True):
        for key in ("num_expert_group", "topk_group"):
            if text.int(key, 1) != 1:
                raise text.error(key, f"grouped top-k with more than one group is not supported, found {text.raw(key)}")
    expert_format, group = _expert_format(text)
    latent = text.int("routed_expert_hidden_size", None)
    num_experts = text.int("num_experts")
    top_k = text.int("num_experts_per_token")
    if top_k > num_experts:
        raise text.error("num_experts_per_token", f"{top_k} exceeds num_experts={num_experts}")
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        num_shared_experts=text.int("num_shared_experts", 0, minimum=0),
        intermediate_size=text.int("moe_intermediate_size"),
        latent_size=latent,
        latent_norm=bool(latent) and text.bool("latent_moe_use_norm", False),
        renormalize=text.bool("moe_renormalize", True),
        routed_scaling_factor=text.float("routed_scaling_factor", 1.0, positive=True),
        expert_format=expert_format,  # type: ignore[arg-type]
        mxfp4_group_size=group,
    )
    if expert_format == "mxfp4":
        for key, width in (("routed_expert_hidden_size or hidden_size", latent or hidden), ("moe_intermediate_size", moe.intermediate_size)):
            if width % group:
                raise text.error(key, f"{width} is not a multiple of the MXFP4 group size {group}")

    block = text.int("attn_res_block_size", None)
    config = ModelConfig(
        name=name or Path(where).parent.name,
        model_type=model_type,
        hidden_size=hidden,
        num_layers=num_layers,
        vocab_size=text.int("vocab_size"),
        rms_norm_eps=text.float("rms_norm_eps", positive=True),
        layer_kinds=kinds,
        first_k_dense_replace=first_k_dense,
        moe_layer_freq=moe_freq,
        dense_intermediate_size=text.int("intermediate_size"),
        activation=act,
        situ_beta=text.float("activation_situ_beta", 4.0, positive=True),
        situ_linear_beta=text.float("activation_situ_linear_beta", None, positive=True),
        attn_res_block_size=block,
        kda=kda,
        mla=mla,
        moe=moe,
        max_context=text.int("model_max_length", None),
        source=where,
    )
    return config


def load_config(model: str | Path) -> ModelConfig:
    """`model` is a preset name (see PRESETS) or a directory holding a config.json (or the file itself)."""
    if str(model) in PRESETS:
        text = resources.files("k3mk.compiler").joinpath("presets", f"{model}.json").read_text()
        return parse_config(json.loads(text), where=f"preset '{model}'", name=str(model))
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"'{model}' is neither a preset ({', '.join(PRESETS)}) nor a directory with a config.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return parse_config(data, where=str(path), name=path.parent.name)
