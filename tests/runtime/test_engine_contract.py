"""The engine contract's refusals without an engine: each bad setting or tensor is a ContractError naming
the tensor, what was expected and what was found (the layouts themselves are held against vLLM in
test_engine_contract_vllm.py)."""

from __future__ import annotations

import pytest
import torch

from k3mk.compiler.config import load_config
from k3mk.compiler.engine_states import engine_state_layouts
from k3mk.passes.tp_shard import TPError
from k3mk.runtime.engine_contract import (
    ContractError,
    KdaStateLayout,
    MlaCacheLayout,
    bind_kda_states,
    bind_mla_cache,
    cache_element_dtype,
)

KDA = KdaStateLayout(conv_rows=4, conv_channels=96, heads=2, head_dim=16)
MLA = MlaCacheLayout(row_width=80, dtype=torch.bfloat16)


def kda_states(slots: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(slots, *KDA.conv_shape, dtype=torch.bfloat16), torch.zeros(slots, *KDA.recurrent_shape)


def test_dense_states_bind():
    binding = bind_kda_states(*kda_states(), KDA, "layer 0")
    assert (binding.num_slots, binding.conv_slot_stride, binding.recurrent_slot_stride) == (3, 4 * 96 * 2, 2 * 16 * 16 * 4)


def test_draft_tokens_beyond_seven_are_refused():
    with pytest.raises(ContractError, match=r"draft tokens per request: expected 0\.\.7, found 8"):
        KdaStateLayout.of_compiled((1, 3, 96), (1, 2, 16, 16), 8)


def test_a_tp_degree_that_does_not_split_the_heads_is_refused():
    with pytest.raises(TPError, match="tensor parallel degree 8 does not divide kda.num_heads = 4"):
        engine_state_layouts(load_config("k3-tiny"), 8, 0, "auto")


@pytest.mark.parametrize(
    "name, why",
    [("fp8_ds_mla", r"'fp8_ds_mla': 656 bytes per token"), ("fp8_e5m2", r"'fp8_e5m2': not a format the kernel reads"),
     ("float16", r"'float16': not a format")],
)  # fmt: skip
def test_other_cache_dtypes_are_refused(name, why):
    with pytest.raises(ContractError, match=why + r".*supported: 'auto' \(the model dtype bfloat16\), 'fp8', 'fp8_e4m3'"):
        cache_element_dtype(name, torch.bfloat16)


def test_a_conv_state_in_the_wrong_dtype_names_the_setting():
    conv, recurrent = kda_states()
    with pytest.raises(ContractError, match=r"layer 0 conv state: expected bfloat16 \(--mamba-cache-dtype auto .*found float32"):
        bind_kda_states(conv.float(), recurrent, KDA, "layer 0")
    with pytest.raises(ContractError, match=r"recurrent state: expected float32 \(--mamba-ssm-cache-dtype auto.*found bfloat16"):
        bind_kda_states(conv, recurrent.bfloat16(), KDA, "layer 0")


def test_padded_slots_bind_but_padded_rows_do_not():
    conv, recurrent = kda_states()
    padded_slots = torch.zeros(3, 2 * KDA.conv_rows * KDA.conv_channels, dtype=torch.bfloat16)[:, : KDA.conv_rows * KDA.conv_channels]
    assert bind_kda_states(padded_slots.view(3, *KDA.conv_shape), recurrent, KDA, "l").conv_slot_stride == 2 * 4 * 96 * 2
    padded_rows = torch.zeros(3, KDA.conv_rows, 2 * KDA.conv_channels, dtype=torch.bfloat16)[:, :, : KDA.conv_channels]
    with pytest.raises(ContractError, match=r"conv state strides \[768, 192, 1\]: expected dense slots \[\*, 96, 1\]"):
        bind_kda_states(padded_rows, recurrent, KDA, "l")


def test_unaligned_states_and_uneven_slot_counts_are_refused():
    conv, recurrent = kda_states()
    with pytest.raises(ContractError, match=r"base address and slot stride must be multiples of 16 bytes \(found 4 and"):
        unaligned = torch.zeros(recurrent.numel() + 1)[1:].view(recurrent.shape)
        bind_kda_states(conv, unaligned, KDA, "l")
    with pytest.raises(ContractError, match="3 conv state slots but 2 recurrent state slots"):
        bind_kda_states(conv, recurrent[:2], KDA, "l")


def test_latent_caches_in_the_wrong_width_or_type_are_refused():
    assert bind_mla_cache(torch.zeros(5, 64, 80, dtype=torch.bfloat16), MLA, "layer 3").block_size == 64
    with pytest.raises(ContractError, match=r"layer 3 latent cache \[5, 64, 96\]: expected \[slots, 64, 80\]"):
        bind_mla_cache(torch.zeros(5, 64, 96, dtype=torch.bfloat16), MLA, "layer 3")
    with pytest.raises(ContractError, match=r"expected bfloat16 \(--kv-cache-dtype\), found uint8"):
        bind_mla_cache(torch.zeros(5, 64, 80, dtype=torch.uint8), MLA, "layer 3")
    e4m3 = MlaCacheLayout(80, torch.float8_e4m3fn)
    assert bind_mla_cache(torch.zeros(5, 64, 80, dtype=torch.uint8), e4m3, "layer 3").block_stride == 64 * 80
    with pytest.raises(ContractError, match=r"expected \[blocks, block_size, 80\]"):
        bind_mla_cache(torch.zeros(64, 80, dtype=torch.bfloat16), MLA, "layer 3")
