"""Asks vLLM what it binds for a model's KDA states and MLA latent cache, and prints it as JSON.

Runs in the vLLM virtual environment (`.venv-vllm`, README "Run the tests"), not in k3mk's: it imports
vLLM and the standard library only, never k3mk, so every number it reports is vLLM's own computation.
tests/runtime/test_engine_contract_vllm.py runs it and holds k3mk's contract (k3mk.runtime.engine_contract)
against the answers.

    .venv-vllm/bin/python tests/runtime/vllm_engine_probe.py REQUEST.json ANSWER.json

REQUEST is a list of cases, each {"config": DIR with a config.json, "tp": N, "num_spec": K,
"cache_dtype": "auto" | "fp8" | ..., "conv_layout": "SD" | "DS", "bind": bool, "kv_layout": NAME}.
For every case the answer has vLLM's calculators' KDA state shapes and dtypes, the MLA head size and KV
heads, and the hybrid block size and padded state page of `Platform._align_hybrid_block_size` (for two
MLA backends that vLLM selects on Hopper-class GPUs and that import without a GPU). With "bind" (TP 1
only: the layers are built in one process), vLLM also builds every attention layer of the model,
sizes a small KV cache with `get_kv_cache_configs`, allocates it with `allocate_kv_cache` and binds it
to the layers: the answer then lists each layer's spec and the views it bound (shape, element strides,
dtype, byte offset in the one backing allocation).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import typing

import torch

KV_BLOCKS = 6  # blocks per layer of the cache a "bind" case allocates: small, but more than one


def model_config(config_dir: str):
    from vllm.config import ModelConfig

    return ModelConfig(model=config_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)


def vllm_config(case: dict):
    """A fresh config per use: VllmConfig applies the model's config hooks (the hybrid model's
    mamba_block_size) once per ModelConfig."""
    from vllm.config import CacheConfig, DeviceConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    # ngram drafting needs no draft model; the KDA layers read only num_speculative_tokens from it
    spec = (SpeculativeConfig(method="ngram", num_speculative_tokens=case["num_spec"], prompt_lookup_max=4, prompt_lookup_min=1)
            if case["num_spec"] else None)  # fmt: skip
    return VllmConfig(
        model_config=model_config(case["config"]),
        parallel_config=ParallelConfig(tensor_parallel_size=case["tp"]),
        speculative_config=spec,
        cache_config=CacheConfig(enable_prefix_caching=False, cache_dtype=case["cache_dtype"]),
        device_config=DeviceConfig(device="cpu"),
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def aligned_block(case: dict, backend) -> dict:
    """The attention block size and padded state page vLLM's hybrid alignment picks for `backend`."""
    from vllm.platforms.interface import Platform

    vc = vllm_config(case)
    Platform._align_hybrid_block_size(vc, backend)
    return {"block_size": vc.cache_config.block_size, "mamba_page_size_padded": vc.cache_config.mamba_page_size_padded}


def calculators(case: dict) -> dict:
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

    vc = vllm_config(case)
    mc = vc.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    shapes = model_cls.get_mamba_state_shape_from_config(vc)
    dtypes = model_cls.get_mamba_state_dtype_from_config(vc)
    return {
        "architecture": mc.architecture,
        "kda_shapes": [list(s) for s in shapes],
        "kda_dtypes": [dtype_name(d) for d in dtypes],
        "mla_head_size": mc.get_head_size(),
        "mla_kv_heads": mc.get_num_kv_heads(vc.parallel_config),
        "aligned": {b.get_name(): aligned_block(case, b) for b in (FlashMLABackend, TritonMLABackend)},
    }


def build_layers(vc) -> dict:
    """Every attention layer of the model, as vLLM's Kimi model builds them (vllm/models/kimi_k3/nvidia)."""
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    text = vc.model_config.hf_text_config
    layers = {}
    for i in range(text.num_hidden_layers):
        prefix = f"model.layers.{i}.self_attn"
        if text.is_kda_layer(i):
            full_rank = text.linear_attn_config.get("use_full_rank_gate", False)  # as KimiDecoderLayer decides
            layers[prefix] = (KimiK3DeltaAttention if full_rank else KimiGatedDeltaNetAttention)(text, vc, prefix=prefix)
        else:
            layers[prefix] = MultiHeadLatentAttention(
                config=text, hidden_size=text.hidden_size, num_heads=text.num_attention_heads,
                qk_nope_head_dim=text.qk_nope_head_dim, qk_rope_head_dim=text.qk_rope_head_dim, v_head_dim=text.v_head_dim,
                q_lora_rank=text.q_lora_rank, kv_lora_rank=text.kv_lora_rank, use_output_gate=bool(text.mla_use_output_gate),
                cache_config=vc.cache_config, quant_config=None, prefix=prefix,
            )  # fmt: skip
    return layers


def bound_views(case: dict) -> dict:
    """Build the layers, size and allocate a KV cache as the runner does, bind it; report the views."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    vc = vllm_config(case)
    vc.cache_config.kv_cache_layout = case["kv_layout"]
    Platform._align_hybrid_block_size(vc, FlashMLABackend)  # the GPU's block size, not the CPU backend's
    with set_current_vllm_config(vc):
        torch.set_default_dtype(torch.bfloat16)
        layers = build_layers(vc)
        specs = {name: layer.get_kv_cache_spec(vc) for name, layer in layers.items()}
        page = max(s.page_size_bytes for s in specs.values())
        (kv_config,) = get_kv_cache_configs(vc, [specs], [KV_BLOCKS * page * len(specs)])
        caches = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout[case["kv_layout"]], None)
        out = {}
        for name, layer in layers.items():
            layer.bind_kv_cache(caches[name])
            bound = layer.kv_cache if isinstance(layer.kv_cache, tuple) else (layer.kv_cache,)
            base = caches[name].untyped_storage().data_ptr()
            spec = specs[name]
            out[name] = {
                "kind": type(spec).__name__,
                "page_size_bytes": spec.page_size_bytes,
                "block_size": spec.block_size,
                "spec_dtypes": [dtype_name(d) for d in getattr(spec, "dtypes", (getattr(spec, "dtype", None),)) if d is not None],
                "head_size": getattr(spec, "head_size", None),
                "views": [{"shape": list(v.shape), "stride": list(v.stride()), "dtype": dtype_name(v.dtype),
                           "offset": v.data_ptr() - base} for v in bound],  # fmt: skip
            }
        torch.set_default_dtype(torch.float32)
    return {"allocation_bytes": caches[next(iter(caches))].untyped_storage().nbytes(), "layers": out}


def answer(case: dict) -> dict:
    from vllm.model_executor.layers.mamba import mamba_utils

    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = case["conv_layout"]
    mamba_utils.get_conv_state_layout.cache_clear()  # vLLM reads the variable once per process
    result = {"case": case, **calculators(case)}
    if case["bind"]:
        result["bound"] = bound_views(case)
    return result


def init_single_rank() -> None:
    """A one-rank gloo group: vLLM's layers ask the tensor-parallel group for their shard sizes."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mkdtemp()}/rendezvous")  # fmt: skip
        initialize_model_parallel(1)


def main(request_path: str, answer_path: str) -> None:
    import vllm
    from vllm.config.cache import CacheDType

    cases = json.loads(open(request_path).read())
    if any(c["bind"] for c in cases):
        init_single_rank()
    answers = [answer(case) for case in cases]
    report = {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
              "cache_dtypes": list(typing.get_args(CacheDType)), "cases": answers}  # fmt: skip
    with open(answer_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
