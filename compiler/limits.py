"""The limits of a compile target, stated here and checked before the pipeline runs (a target that
cannot be built costs milliseconds, not the minutes of the passes):

- tokens per step: 1 to codegen's MAX_BATCH (16 = requests x (1 + draft tokens), DESIGN.md);
- context: 1 to the model's own maximum (config max_position_embeddings / model_max_length) and to
  2^31 - 1 (positions are int32 step inputs); the decode state it needs on one rank must fit the
  largest GPU of the target arch (runtime/schema.py ARCHS);
- kernel shapes: the op records that the pipeline emits for every config of the family, derived from
  the config alone, go through codegen's own checks (codegen/ops.py OP_CODEGEN[op].check), so a width
  the templates cannot generate is reported against the config field before the passes run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from k3mk.codegen.ops import MAX_BATCH, OP_CODEGEN, CodegenError
from k3mk.compiler.config import ModelConfig
from k3mk.ir.task_table import (
    AttnResParams,
    EmbeddingParams,
    ExpertCombineParams,
    ExpertGatedParams,
    KdaConvParams,
    KdaRecurrenceParams,
    MlaLatentParams,
    OpVariant,
    RouterTopkParams,
)
from k3mk.runtime.schema import ARCHS

if TYPE_CHECKING:
    from k3mk.compiler.weights import TensorSpec

MAX_POSITION = 2**31 - 1  # positions are int32 step inputs (docs/task_table.md, format 3)
COMPILE_BYTES = 2  # the compile's activation (compute) dtype is bfloat16


class CompileError(ValueError):
    """The compile target cannot be built (bad degree, arch, rank, limit); the message names the option."""


def check_tokens(max_tokens: int) -> None:
    if not 1 <= max_tokens <= MAX_BATCH:
        raise CompileError(f"--max-tokens {max_tokens}: the megakernel runs 1 to {MAX_BATCH} tokens per step (requests x (1 + draft tokens))")


@dataclass(frozen=True)
class StateSize:
    """Decode state bytes on one rank: KDA conv + recurrent states, MLA latent caches."""

    kda: int
    mla: int

    @property
    def total(self) -> int:
        return self.kda + self.mla

    def text(self) -> str:
        return f"{format_bytes(self.total)} (KDA states {format_bytes(self.kda)}, MLA latent cache {format_bytes(self.mla)})"


def state_size(config: ModelConfig, tp: int, max_tokens: int, max_context: int, compute_bytes: int = COMPILE_BYTES) -> StateSize:
    """The decode state of one rank (passes/tp_shard.py splits the KDA states, replicates the latent cache)."""
    from k3mk.compiler.weights import state_specs  # with torch: imported here, so that check_tokens runs before torch loads
    from k3mk.passes.tp_shard import state_split

    sizes = {"kda": 0, "mla": 0}
    for spec in state_specs(config, max_tokens, max_context):
        parts = tp if state_split(spec.name) is not None else 1
        sizes["mla" if spec.name.endswith("kv_cache") else "kda"] += spec.numel * _element_bytes(spec, compute_bytes) // parts
    return StateSize(**sizes)


def weight_bytes(config: ModelConfig, compute_bytes: int) -> int:
    """All weights of the model (one process, no tensor parallelism), as loaded."""
    from k3mk.compiler.weights import weight_specs

    return sum(spec.numel * _element_bytes(spec, compute_bytes) for spec in weight_specs(config))


def _element_bytes(spec: "TensorSpec", compute_bytes: int) -> int:
    return {"compute": compute_bytes, "float32": 4, "uint8": 1}[spec.dtype]


def check_context(config: ModelConfig, tp: int, max_tokens: int, max_context: int, arch: str) -> StateSize:
    """The context bounds and the decode state they need (returned), against the arch's largest GPU."""
    limit = min(config.max_context or MAX_POSITION, MAX_POSITION)
    if not 1 <= max_context <= limit:
        why = f"the model's maximum (max_position_embeddings of {config.name})" if config.max_context and config.max_context <= MAX_POSITION else "int32 positions"
        raise CompileError(f"--max-context {max_context}: supported 1 to {limit} ({why})")
    state = state_size(config, tp, max_tokens, max_context)
    gpu = ARCHS[arch]
    if state.total > gpu.memory_bytes:
        raise CompileError(
            f"--max-context {max_context}: the decode state needs {state.text()} per rank at --max-tokens {max_tokens} "
            f"--tp {tp}, more than the {format_bytes(gpu.memory_bytes)} of the largest {arch} GPU ({gpu.devices})"
        )
    return state


def kernel_records(config: ModelConfig, tp: int, batch: int, max_context: int) -> list[tuple[str, OpVariant]]:
    """(the config fields it depends on, an op record the pipeline emits for this target) for the ops
    every config of the family has; tests/compiler/test_limits.py checks they are among the emitted ones."""
    c, k, m, moe = config, config.kda, config.mla, config.moe
    records = [("hidden_size", OpVariant("embedding", EmbeddingParams(dim=c.hidden_size, vocab=c.vocab_size, batch=batch)))]
    if c.kda_layers:
        records += [
            ("the KDA head_dim", OpVariant("kda_recurrence", KdaRecurrenceParams(num_heads=k.num_heads // tp, head_dim=k.head_dim, batch=batch))),
            ("the KDA short_conv_kernel_size and num_heads x head_dim", OpVariant("kda_conv", KdaConvParams(channels=k.proj_size // tp, batch=batch, width=k.conv_size))),
        ]  # fmt: skip
    if c.mla_layers:
        latent = MlaLatentParams(kv_lora_rank=m.kv_lora_rank, rope_dim=m.qk_rope_head_dim, max_len=max_context, batch=batch, eps=m.latent_norm_eps)
        records.append(("kv_lora_rank and qk_rope_head_dim", OpVariant("mla_latent", latent)))
    if any(c.is_moe_layer(i) for i in range(c.num_layers)):
        width, inner = moe.latent_size or c.hidden_size, moe.intermediate_size // tp
        fmt = "mxfp4" if moe.expert_format == "mxfp4" else "bfloat16"
        act = {"activation": "situ", "beta": c.situ_beta, "linear_beta": c.situ_linear_beta} if c.activation == "situ" else {"activation": "silu"}
        common = {"num_experts": moe.num_experts, "batch": batch, "top_k": moe.top_k}
        # the MoE adds the combine takes (passes/fuse_residual.py): + shared, then the residual stream; none where the
        # combine feeds the latent up-projection or an all-reduce (tp > 1)
        combine_residuals = 0 if moe.latent_size or tp > 1 else 1 + (moe.num_shared_experts > 0)
        records += [
            ("the routed experts' input width (routed_expert_hidden_size or hidden_size)",
             OpVariant("expert_gated", ExpertGatedParams(in_features=width, out_features=inner, weight_format=fmt, **common, **act))),
            ("moe_intermediate_size", OpVariant("expert_combine", ExpertCombineParams(in_features=inner, out_features=width, weight_format=fmt,
                                                                                        residuals=combine_residuals, **common))),
            ("num_experts and num_experts_per_token",  # the top-k half of the router, fused with its GEMV or not
             OpVariant("router_topk", RouterTopkParams(renormalize=moe.renormalize, scaling=moe.routed_scaling_factor, **common))),
        ]  # fmt: skip
    if c.attn_res_block_size:
        sources = -(-c.num_layers // c.attn_res_block_size) + 1  # every block of layers, then the running prefix (spec 6)
        records.append(("attn_res_block_size (blocks of layers)", OpVariant("attn_res", AttnResParams(dim=c.hidden_size, batch=batch, num_sources=sources, eps=c.rms_norm_eps))))
    return records


def check_kernel_shapes(config: ModelConfig, tp: int, max_tokens: int, max_context: int) -> None:
    for fields, variant in kernel_records(config, tp, max_tokens, max_context):
        try:
            OP_CODEGEN[variant.op].check(variant.params)
        except CodegenError as e:
            at = f" at --tp {tp}" if tp > 1 else ""
            raise CompileError(f"{config.source}: {fields}{at}: {e} (a limit of the megakernel's op templates, codegen/ops.py)") from None


def format_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
