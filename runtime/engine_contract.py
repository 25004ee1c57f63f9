"""What the kernel binds when a serving engine owns the decode state (docs/engine_contract.md, "Caches
and states"): one KDA layer's state slot and one MLA layer's latent-cache row per TP rank, in the
engine's own layouts, and the bind-time checks of the engine's tensors. The layouts are built from a
rank's compiled dense states (the manifest's `states`), so what is checked here is what the artifact
reads; tests/runtime/test_engine_contract_vllm.py holds them against vLLM's own calculators and the views
its runner binds.

Every check raises ContractError naming the tensor, what was expected and what was found. Nothing here
assumes dense packing: an engine's caches are strided views into one shared allocation (vLLM pads state
pages to the attention page and overlays the KV cache groups), so a binding keeps each tensor's base
address and slot / block stride.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KDA_CONV_DTYPE = torch.bfloat16  # vLLM's default conv state dtype (the model dtype), spec 8
KDA_RECURRENT_DTYPE = torch.float32  # vLLM's default KDA recurrent state dtype (kda_state_dtype, "auto")
ALIGNMENT = 16  # bytes: the kernel's vector loads of state rows and cache rows
MAX_DRAFT_TOKENS = 7  # verify steps of 1 + K tokens per request, K <= 7 (docs/engine_contract.md "Buckets")

# vLLM --kv-cache-dtype names k3mk reads: the latent row stored in the model dtype, or as E4M3 with one
# fp32 scale per tensor (vLLM stores it as uint8 and reads it as float8_e4m3fn).
_E4M3_NAMES = ("fp8", "fp8_e4m3")
_REFUSED_CACHE_DTYPES = {
    "fp8_ds_mla": "656 bytes per token (E4M3 latent with per-128 group scales and a bf16 rope part), "
    "not rows of 576 values",
}


class ContractError(ValueError):
    """An engine tensor or setting outside the contract; the message names it, expected vs found."""


@dataclass(frozen=True)
class KdaStateLayout:
    """One KDA layer's state slot on one TP rank, in vLLM's default "SD" layout: the conv window
    [conv_rows, conv_channels] (this rank's q | k | v channels, oldest input first; conv_size - 1 rows
    plus one per draft token, spec 8) and the fp32 delta-rule state [heads, head_dim (v), head_dim (k)]."""

    conv_rows: int
    conv_channels: int
    heads: int
    head_dim: int

    @classmethod
    def of_compiled(cls, conv_state: tuple[int, ...], recurrent_state: tuple[int, ...], draft_tokens: int) -> KdaStateLayout:
        """From a rank's compiled dense states [batch, W-1, C] and [batch, H, D, D]: a verify step of
        1 + draft_tokens tokens keeps W-1+draft_tokens conv rows (vLLM kda_state_shape, num_spec)."""
        if not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise ContractError(f"draft tokens per request: expected 0..{MAX_DRAFT_TOKENS}, found {draft_tokens}")
        _, rows, channels = conv_state
        _, heads, head_dim, head_dim_k = recurrent_state
        if head_dim != head_dim_k:
            raise ContractError(f"recurrent state {list(recurrent_state)}: expected [batch, H, D, D]")
        return cls(rows + draft_tokens, channels, heads, head_dim)

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_rows, self.conv_channels)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.head_dim, self.head_dim)

    @property
    def slot_bytes(self) -> int:
        """The state of one slot, unpadded: conv window, then the recurrent state (vLLM packs them in
        this order into one page, MambaBase.bind_kv_cache)."""
        return self.conv_rows * self.conv_channels * KDA_CONV_DTYPE.itemsize + self.heads * self.head_dim**2 * KDA_RECURRENT_DTYPE.itemsize


@dataclass(frozen=True)
class MlaCacheLayout:
    """One MLA layer's latent cache row on any TP rank (one latent KV head, replicated): rmsnorm(c_kv)
    || k_pe, `row_width` values (576 for K3) in `dtype`; E4M3 rows come with one fp32 scale per layer."""

    row_width: int
    dtype: torch.dtype

    @classmethod
    def of_compiled(cls, kv_cache: tuple[int, ...], cache_dtype: str, model_dtype: torch.dtype) -> MlaCacheLayout:
        """From a rank's compiled dense cache [batch, max_context, width] and the engine's cache dtype
        name (vLLM --kv-cache-dtype: "auto" is the model dtype)."""
        return cls(kv_cache[-1], cache_element_dtype(cache_dtype, model_dtype))

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.dtype.itemsize

    @property
    def stored_dtypes(self) -> tuple[torch.dtype, ...]:
        """What an engine's cache tensor may be typed as: vLLM keeps E4M3 caches as uint8."""
        return (self.dtype, torch.uint8) if self.dtype == torch.float8_e4m3fn else (self.dtype,)


def cache_element_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The latent row's element type for an engine cache dtype name, or ContractError."""
    if cache_dtype in ("auto", str(model_dtype).removeprefix("torch.")):
        return model_dtype
    if cache_dtype in _E4M3_NAMES:
        return torch.float8_e4m3fn
    why = _REFUSED_CACHE_DTYPES.get(cache_dtype, "not a format the kernel reads")
    raise ContractError(
        f"kv cache dtype {cache_dtype!r}: {why}; supported: 'auto' (the model dtype "
        f"{str(model_dtype).removeprefix('torch.')}), {', '.join(map(repr, _E4M3_NAMES))} (E4M3 + per-tensor scale)"
    )


@dataclass(frozen=True)
class KdaBinding:
    """An engine's state tensors of one KDA layer as the kernel addresses them: slot s of the conv
    window at conv base + s * conv_slot_stride bytes, its recurrent state at recurrent base + s *
    recurrent_slot_stride bytes; inside a slot both are dense."""

    num_slots: int
    conv_slot_stride: int
    recurrent_slot_stride: int


@dataclass(frozen=True)
class MlaBinding:
    """An engine's latent cache of one MLA layer: token t of a request lives in block
    block_table[t // block_size] at row t % block_size; blocks are block_stride bytes apart, rows dense."""

    num_blocks: int
    block_size: int
    block_stride: int


def bind_kda_states(conv: torch.Tensor, recurrent: torch.Tensor, layout: KdaStateLayout, where: str) -> KdaBinding:
    """Check one KDA layer's engine state tensors against the layout: conv [slots, rows, channels] (SD),
    recurrent [slots, H, D, D], default dtypes, dense inside a slot, 16-byte aligned slots."""
    transposed = layout.conv_shape[::-1]
    if conv.dim() == 3 and tuple(conv.shape[1:]) == transposed and transposed != layout.conv_shape:
        raise ContractError(
            f"{where} conv state {list(conv.shape)}: vLLM's DS layout (VLLM_SSM_CONV_STATE_LAYOUT=DS); the kernel "
            f"reads the default SD layout [slots, {layout.conv_rows}, {layout.conv_channels}]: unset the variable"
        )
    _check(conv, f"{where} conv state", layout.conv_shape, (KDA_CONV_DTYPE,), "--mamba-cache-dtype auto (the model dtype)")
    _check(recurrent, f"{where} recurrent state", layout.recurrent_shape, (KDA_RECURRENT_DTYPE,), "--mamba-ssm-cache-dtype auto (float32)")
    if conv.shape[0] != recurrent.shape[0]:
        raise ContractError(f"{where}: {conv.shape[0]} conv state slots but {recurrent.shape[0]} recurrent state slots")
    return KdaBinding(conv.shape[0], _slot_stride(conv), _slot_stride(recurrent))


def bind_mla_cache(cache: torch.Tensor, layout: MlaCacheLayout, where: str) -> MlaBinding:
    """Check one MLA layer's engine cache [blocks, block_size, row_width]: the block size is the
    engine's (vLLM grows it to fit the KDA state pages), rows dense inside a block, 16-byte aligned."""
    if cache.dim() != 3:
        raise ContractError(f"{where} latent cache {list(cache.shape)}: expected [blocks, block_size, {layout.row_width}]")
    _check(cache, f"{where} latent cache", (cache.shape[1], layout.row_width), layout.stored_dtypes, "--kv-cache-dtype")
    return MlaBinding(cache.shape[0], cache.shape[1], _slot_stride(cache))


def _check(tensor: torch.Tensor, what: str, per_slot: tuple[int, ...], dtypes: tuple[torch.dtype, ...], setting: str) -> None:
    """[slots, *per_slot] of one of `dtypes`, dense inside a slot (any slot stride), 16-byte aligned."""
    names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    if tuple(tensor.shape[1:]) != tuple(per_slot):
        raise ContractError(f"{what} {list(tensor.shape)}: expected [slots, {', '.join(map(str, per_slot))}]")
    if tensor.dtype not in dtypes:
        raise ContractError(f"{what}: expected {names} ({setting}), found {str(tensor.dtype).removeprefix('torch.')}")
    dense = torch.empty(per_slot, device="meta").stride()  # row-major strides of one slot
    if tuple(tensor.stride()[1:]) != dense:
        raise ContractError(f"{what} strides {list(tensor.stride())}: expected dense slots [*, {', '.join(map(str, dense))}]")
    if tensor.data_ptr() % ALIGNMENT or _slot_stride(tensor) % ALIGNMENT:
        raise ContractError(f"{what}: base address and slot stride must be multiples of {ALIGNMENT} bytes "
                            f"(found {tensor.data_ptr() % ALIGNMENT} and {_slot_stride(tensor)} bytes)")  # fmt: skip


def _slot_stride(tensor: torch.Tensor) -> int:
    return tensor.stride(0) * tensor.element_size()
