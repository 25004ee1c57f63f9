"""The reference decode step against an independent implementation: transformers' KimiLinearForCausalLM.

Each case builds a small Kimi Linear model in transformers, re-randomizes EVERY parameter (its default
init leaves norms at 1 and the router near uniform, which would hide mistakes), writes it with
transformers' own save_pretrained, and loads that directory with k3mk (load_config + load_checkpoint).
Then (a) k3mk's DecodeStep fed the prompt one token per step gives the logits of transformers' full
forward at every position, and fed on with the generated tokens the logits of transformers' cached
decode steps; (b) `k3mk generate` prints the tokens of transformers' greedy generate.

transformers runs without flash-linear-attention / causal-conv1d here, so it uses its PyTorch
fallbacks, and different ones per phase: a full forward and the prefill of generate go through
`chunk_kimi_delta_attention` (the chunked WY form of KDA) and `causal_conv1d_fn`; each generated token
goes through `recurrent_kimi_delta_attention` and `causal_conv1d_update`. test_code_paths pins that,
so k3mk's recurrence is checked against both of transformers' formulations.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.kimi_linear import modeling_kimi_linear  # noqa: E402

from k3mk.compiler.checkpoint import load_checkpoint  # noqa: E402
from k3mk.compiler.cli import main  # noqa: E402
from k3mk.compiler.config import load_config  # noqa: E402
from k3mk.compiler.generate import build_decode_step  # noqa: E402

PROMPT_LENGTH = 24
GENERATE_STEPS = 32
# Greedy tokens can only be compared where transformers' top-1/top-2 logit gap is far above the logit
# error (~1e-6 relative, ~1e-5 absolute measured): the test demands such gaps at every step.
MIN_TOP2_GAP = 1e-3

# Two configs that exercise different shapes and paths. Both end with an MLA layer, as the published
# models do, and put layer types out of the every-fourth pattern so the 1-based lists are exercised.
CASES = {
    # odd sizes everywhere: hidden 72, 3 KDA heads of 16, 3 MLA heads, vocab 131; plain q_proj. The KDA
    # fields as the published `linear_attn_config` dict, which save_pretrained writes back WITHOUT
    # `mla_use_nope` (transformers' MLA is always NoPE): k3mk must load that as it is.
    "odd": dict(
        vocab_size=131, hidden_size=72, intermediate_size=100, moe_intermediate_size=40, num_hidden_layers=4,
        linear_attn_config=dict(kda_layers=[1, 3], full_attn_layers=[2, 4], num_heads=3, head_dim=16, short_conv_kernel_size=4),
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        num_attention_heads=3, num_key_value_heads=3, q_lora_rank=None, kv_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        num_local_experts=6, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.446,
    ),
    # q-LoRA, two dense layers, two shared experts, conv kernel 3, no top-k renormalization
    "q_lora": dict(
        vocab_size=257, hidden_size=136, intermediate_size=88, moe_intermediate_size=28, num_hidden_layers=5,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"],
        num_attention_heads=5, num_key_value_heads=5, q_lora_rank=40, kv_lora_rank=32,
        qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10,
        linear_num_heads=2, linear_head_dim=24, linear_conv_kernel_dim=3,
        num_local_experts=7, num_experts_per_tok=3, n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.0,
    ),
}  # fmt: skip


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and buffer at a scale that keeps activations O(1) and every path non-trivial:
    matrices N(0, 1/fan_in); norm gains U(0.5, 1.5); KDA decay rates exp(A_log) in [0.1, 1] with dt_bias
    N(0, 1), so a step keeps between ~5 % and ~99 % of the state per channel; conv taps N(0, 0.5^2);
    router logits and the head's logits spread by 3x so top-k routing and greedy choices have clear
    margins; a correction bias that moves selections."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        shape = tensor.shape
        if name.endswith("A_log"):
            value = torch.empty(shape).uniform_(math.log(0.1), 0.0, generator=gen)
        elif name.endswith("dt_bias"):
            value = torch.randn(shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            value = 0.1 * torch.randn(shape, generator=gen)
        elif "norm" in name:  # every RMSNorm gain, o_norm included
            value = torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
        elif "conv1d" in name:
            value = 0.5 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name:
            value = torch.randn(shape, generator=gen)
        elif name.endswith("mlp.gate.weight") or name == "lm_head.weight":
            value = 3.0 * torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        elif tensor.dim() >= 2:  # Linear [out, in] and stacked experts [E, out, in]
            value = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        else:
            raise AssertionError(f"no random init for {name} {tuple(shape)}")
        with torch.no_grad():
            tensor.copy_(value)


@dataclass
class Case:
    """One model, run once by transformers: its checkpoint, the prompt, transformers' full-forward logits
    over the prompt, its greedy generation (tokens and per-step logits), and how often each of its KDA
    code paths ran in the forward and in generate."""

    name: str  # in CASES
    model: torch.nn.Module
    directory: Path
    prompt: torch.Tensor  # [PROMPT_LENGTH]
    forward_logits: torch.Tensor  # [PROMPT_LENGTH, V]
    generated: list[int]  # GENERATE_STEPS tokens
    generate_logits: torch.Tensor  # [GENERATE_STEPS, V]: the logits each generated token was chosen from
    forward_calls: dict[str, int]
    generate_calls: dict[str, int]
    routing: list[tuple[torch.Tensor, torch.Tensor, int]]  # per MoE layer of the forward: (scores, bias, top_k)


_KDA_PATHS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update")


@contextmanager
def counting_kda_paths(calls: dict[str, int]):
    """Count calls of transformers' KDA / short-conv functions (looked up as module globals at call time)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in _KDA_PATHS:
            original = getattr(modeling_kimi_linear, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                calls[_name] = calls.get(_name, 0) + 1
                return _original(*args, **kwargs)

            patch.setattr(modeling_kimi_linear, name, counted)
        yield


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory) -> Case:
    torch.manual_seed(0)
    config = transformers.KimiLinearConfig(**CASES[request.param], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.KimiLinearForCausalLM(config).eval()
    randomize(model, seed=len(request.param))
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    prompt = torch.randint(0, config.vocab_size, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(1))
    forward_calls: dict[str, int] = {}
    generate_calls: dict[str, int] = {}
    routing = []

    def record_routing(router, inputs, _):
        x = inputs[0].reshape(-1, router.hidden_dim).float()
        routing.append((torch.sigmoid(x @ router.weight.float().T), router.e_score_correction_bias.clone(), router.top_k))

    routers = [m for m in model.modules() if isinstance(m, modeling_kimi_linear.KimiLinearTopkRouter)]
    hooks = [router.register_forward_hook(record_routing) for router in routers]
    with torch.no_grad():
        with counting_kda_paths(forward_calls):
            forward_logits = model(prompt[None], use_cache=False).logits[0]
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        with counting_kda_paths(generate_calls):
            out = model.generate(
                prompt[None], max_new_tokens=GENERATE_STEPS, do_sample=False, use_cache=True,
                return_dict_in_generate=True, output_logits=True,
            )  # fmt: skip
    return Case(
        name=request.param,
        model=model,
        directory=directory,
        prompt=prompt,
        forward_logits=forward_logits,
        generated=out.sequences[0, PROMPT_LENGTH:].tolist(),
        generate_logits=torch.stack(out.logits)[:, 0],
        forward_calls=forward_calls,
        generate_calls=generate_calls,
        routing=routing,
    )


def in_transformers_layout(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """k3mk's canonical weights renamed and re-stacked into transformers' in-memory layout (the inverse
    of its conversion_mapping for kimi_linear: forget-gate submodule, fused q|k|v conv, `mlp.` prefix,
    experts packed as gate_up_proj [E, 2I, d] and down_proj [E, d, I])."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        layer, _, rest = name.partition(".self_attn.")
        if rest in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
            out[f"{layer}.self_attn.forget_gate.{rest}"] = tensor.reshape(1, 1, -1, 1) if rest == "A_log" else tensor
        elif rest == "q_conv1d.weight":
            out[f"{layer}.self_attn.conv1d.weight"] = torch.cat([weights[f"{layer}.self_attn.{x}_conv1d.weight"] for x in "qkv"])
        elif rest in ("k_conv1d.weight", "v_conv1d.weight"):
            continue
        elif name.endswith(".experts.w1.weight"):
            out[name.replace("block_sparse_moe.experts.w1.weight", "mlp.experts.gate_up_proj")] = torch.cat(
                [tensor, weights[name.replace(".w1.", ".w3.")]], dim=1
            )
        elif name.endswith(".experts.w2.weight"):
            out[name.replace("block_sparse_moe.experts.w2.weight", "mlp.experts.down_proj")] = tensor
        elif name.endswith(".experts.w3.weight"):
            continue
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
    return out


def test_weights_round_trip(case):
    """k3mk reads back exactly the tensors transformers holds: every one, bit for bit (with the config
    transformers saved, whichever form its KDA fields took)."""
    saved = json.loads((case.directory / "config.json").read_text())
    assert ("linear_attn_config" in saved) == ("linear_attn_config" in CASES[case.name]) and "mla_use_nope" not in saved
    config = load_config(case.directory)
    ours = in_transformers_layout(load_checkpoint(config, case.directory))
    theirs = case.model.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_code_paths(case):
    """transformers' full forward and generate's prefill use the chunked KDA; each later token the recurrent one."""
    kda_layers = sum(t == "linear_attention" for t in case.model.config.layer_types)
    assert case.forward_calls == {"chunk_kimi_delta_attention": kda_layers, "causal_conv1d_fn": kda_layers}
    decode_steps = GENERATE_STEPS - 1
    assert case.generate_calls == {
        "chunk_kimi_delta_attention": kda_layers,
        "causal_conv1d_fn": kda_layers,
        "recurrent_kimi_delta_attention": decode_steps * kda_layers,
        "causal_conv1d_update": decode_steps * kda_layers,
    }


def test_routing_is_exercised(case):
    """The parity means something for the MoE only if routing is non-trivial and unambiguous: every
    expert is chosen somewhere, the correction bias changes some selections, and no selection is a
    near tie (k-th vs (k+1)-th selection score, far above the ~1e-6 differences between the two sides)."""
    routing = case.routing
    assert routing
    for scores, bias, top_k in routing:
        chosen = (scores + bias).topk(top_k).indices
        assert chosen.unique().numel() == scores.shape[1]
        ranked = (scores + bias).sort(-1, descending=True).values
        assert (ranked[:, top_k - 1] - ranked[:, top_k]).min() > 1e-4
    changed = sum(
        int((((s + b).topk(k).indices.sort().values) != s.topk(k).indices.sort().values).any(-1).sum()) for s, b, k in routing
    )
    assert changed > 0


def test_logits_match(case):
    """(a) DecodeStep fed the prompt token by token gives transformers' full-forward logits at every
    position; fed on with the generated tokens, it gives the logits of transformers' cached decode."""
    config = load_config(case.directory)
    step = build_decode_step(config, load_checkpoint(config, case.directory), torch.float32)
    sequence = case.prompt.tolist() + case.generated
    state = step.new_state(1, len(sequence))
    ours = []
    with torch.no_grad():
        for position, token in enumerate(sequence[:-1]):
            logits, state = step(torch.tensor([token]), torch.tensor([position]), state)
            ours.append(logits[0])
    ours = torch.stack(ours)
    theirs = torch.cat([case.forward_logits, case.generate_logits[1:]])  # generate_logits[0] is the prompt's last
    assert torch.allclose(case.generate_logits[0], case.forward_logits[-1], rtol=1e-4, atol=1e-4)
    errors = (ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)
    assert errors[:PROMPT_LENGTH].max() < 1e-4, f"prompt positions: relative errors {errors[:PROMPT_LENGTH].tolist()}"
    assert errors[PROMPT_LENGTH:].max() < 1e-4, f"generated positions: relative errors {errors[PROMPT_LENGTH:].tolist()}"
    # the comparison means something only if the logits move with the context
    assert (theirs[1:] - theirs[:-1]).norm(dim=-1).min() > 0.1 * theirs.norm(dim=-1).mean()


def test_generate_matches_transformers_greedy(case, capsys):
    """(b) `k3mk generate` prints transformers' greedy tokens (use_cache, do_sample=False)."""
    top2 = case.generate_logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > MIN_TOP2_GAP, "a near tie: pick another seed"
    capsys.readouterr()
    argv = ["generate", "--model", str(case.directory), "--checkpoint", str(case.directory)]
    argv += ["--prompt", ",".join(map(str, case.prompt.tolist())), "--steps", str(GENERATE_STEPS)]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, case.generated))
