"""Parameter shapes of published language models, as :class:`ParamSpec` lists (no weights).

Check the counts against the published totals:

    .venv/bin/python benchmarks/model_shapes.py

Shared by ``benchmarks/layout_scale.py`` (the planner at scale) and
``benchmarks/project.py`` (time and memory projected to many GPUs). Every
builder returns the trainable parameters in the registration order of the
reference implementation (Hugging Face ``transformers`` modules, nanoGPT for
GPT-2), so the planner's backward order (the reverse) is the one a real model
would have. Tied tensors appear once, as ``named_parameters()`` lists them.
All parameters are bf16 (mixed-precision training with bf16 weights).

Note [routing in the shapes]
    ``muon_param_groups`` sends embeddings, the output head and every vector to
    AdamW; every other matrix (attention, MLP, expert and router weights) to
    Muon. :attr:`ModelShapes.adamw_matrices` names the 2-D parameters that the
    rules send to AdamW (embeddings and head), so
    :meth:`ModelShapes.uses_muon` mirrors the rules without building a module.

Note [experts]
    Routed expert weights get ``kind="expert"``: the planner gives them their own
    buffer (one per dtype and kind) and plans it exactly like a dense buffer,
    over the same ``dp`` ranks. The library has no expert-parallel layout yet
    (``ProcessGroups.expert_dp`` is reserved and unused), so an expert matrix is
    owned whole by one data-parallel rank, like any other matrix. Shared experts
    and routers are dense, as in Megatron-LM (they are replicated across
    expert-parallel ranks there).

Note [DeepSeek-V3 approximations]
    Multi-head latent attention is modelled by its five projection matrices with
    the published shapes (q_a 7168->1536, q_b 1536->24576 = 128 heads x 192,
    kv_a 7168->576 = 512 latent + 64 rope, kv_b 512->32768 = 128 heads x 256,
    o 16384->7168) and its two latent RMSNorm gains (1536, 512). Left out: the
    multi-token-prediction module (about 14B parameters in the released
    checkpoint, not part of the 671B), and the router's
    ``e_score_correction_bias`` (256 per layer, updated by a rule, not by
    gradient). Newton–Schulz sees ``kv_b`` and ``q_b`` as single matrices
    (some implementations orthogonalize per head).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from lightning_layerwise.layout import ParamSpec

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class ModelShapes:
    """One model's trainable parameters and what the count should be."""

    name: str
    specs: tuple[ParamSpec, ...]
    adamw_matrices: frozenset[str]
    """2-D parameters ``muon_param_groups`` sends to AdamW: embeddings and output head."""
    published: int
    """Published total parameter count."""
    source: str
    """Where the published count and the shapes come from."""

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    def uses_muon(self, spec: ParamSpec) -> bool:
        """Whether Note [routing in the shapes] sends ``spec`` to Muon."""
        return len(spec.shape) >= 2 and spec.name not in self.adamw_matrices

    def routed_specs(self, fill: bool = True) -> tuple[ParamSpec, ...]:
        """The specs as ``LayerwiseStrategy`` plans them for ``lightning_layerwise.Muon``: the AdamW
        parameters marked element-wise (split across shards) unless ``fill`` is off."""
        if not fill:
            return self.specs
        return tuple(replace(s, elementwise=not self.uses_muon(s)) for s in self.specs)

    @property
    def muon_matrices(self) -> int:
        return sum(self.uses_muon(s) for s in self.specs)


def _p(name: str, *shape: int, expert: bool = False) -> ParamSpec:
    return ParamSpec(name, tuple(shape), DTYPE, "expert" if expert else "dense")


# --- GPT-2 (nanoGPT module order, Linear weights as (out, in), head tied to wte) ----------------

def gpt2(n_layer: int, d: int, vocab: int = 50257, n_ctx: int = 1024) -> list[ParamSpec]:
    specs = [_p("transformer.wte.weight", vocab, d), _p("transformer.wpe.weight", n_ctx, d)]
    for i in range(n_layer):
        b = f"transformer.h.{i}."
        specs += [
            _p(b + "ln_1.weight", d), _p(b + "ln_1.bias", d),
            _p(b + "attn.c_attn.weight", 3 * d, d), _p(b + "attn.c_attn.bias", 3 * d),
            _p(b + "attn.c_proj.weight", d, d), _p(b + "attn.c_proj.bias", d),
            _p(b + "ln_2.weight", d), _p(b + "ln_2.bias", d),
            _p(b + "mlp.c_fc.weight", 4 * d, d), _p(b + "mlp.c_fc.bias", 4 * d),
            _p(b + "mlp.c_proj.weight", d, 4 * d), _p(b + "mlp.c_proj.bias", d),
        ]
    return specs + [_p("transformer.ln_f.weight", d), _p("transformer.ln_f.bias", d)]


# --- Llama / Mixtral (transformers LlamaForCausalLM / MixtralForCausalLM order) -------------------

def _gqa_attention(prefix: str, d: int, n_heads: int, n_kv_heads: int) -> list[ParamSpec]:
    head_dim = d // n_heads
    kv = n_kv_heads * head_dim
    return [_p(prefix + "q_proj.weight", d, d), _p(prefix + "k_proj.weight", kv, d),
            _p(prefix + "v_proj.weight", kv, d), _p(prefix + "o_proj.weight", d, n_heads * head_dim)]


def _swiglu(prefix: str, d: int, ffn: int, expert: bool = False) -> list[ParamSpec]:
    return [_p(prefix + "gate_proj.weight", ffn, d, expert=expert), _p(prefix + "up_proj.weight", ffn, d, expert=expert),
            _p(prefix + "down_proj.weight", d, ffn, expert=expert)]


def llama(n_layer: int, d: int, ffn: int, n_heads: int, n_kv_heads: int = 8, vocab: int = 128256) -> list[ParamSpec]:
    specs = [_p("model.embed_tokens.weight", vocab, d)]
    for i in range(n_layer):
        b = f"model.layers.{i}."
        specs += _gqa_attention(b + "self_attn.", d, n_heads, n_kv_heads)
        specs += _swiglu(b + "mlp.", d, ffn)
        specs += [_p(b + "input_layernorm.weight", d), _p(b + "post_attention_layernorm.weight", d)]
    return specs + [_p("model.norm.weight", d), _p("lm_head.weight", vocab, d)]


def mixtral(n_layer: int = 32, d: int = 4096, ffn: int = 14336, n_experts: int = 8, n_heads: int = 32,
            n_kv_heads: int = 8, vocab: int = 32000) -> list[ParamSpec]:
    specs = [_p("model.embed_tokens.weight", vocab, d)]
    for i in range(n_layer):
        b = f"model.layers.{i}."
        specs += _gqa_attention(b + "self_attn.", d, n_heads, n_kv_heads)
        specs.append(_p(b + "block_sparse_moe.gate.weight", n_experts, d))
        for e in range(n_experts):
            x = f"{b}block_sparse_moe.experts.{e}."
            specs += [_p(x + "w1.weight", ffn, d, expert=True), _p(x + "w2.weight", d, ffn, expert=True),
                      _p(x + "w3.weight", ffn, d, expert=True)]
        specs += [_p(b + "input_layernorm.weight", d), _p(b + "post_attention_layernorm.weight", d)]
    return specs + [_p("model.norm.weight", d), _p("lm_head.weight", vocab, d)]


# --- DeepSeek-V3 (transformers DeepseekV3ForCausalLM order; see Note [DeepSeek-V3 approximations]) --

def _mla(prefix: str, d: int) -> list[ParamSpec]:
    return [
        _p(prefix + "q_a_proj.weight", 1536, d), _p(prefix + "q_a_layernorm.weight", 1536),
        _p(prefix + "q_b_proj.weight", 128 * 192, 1536),
        _p(prefix + "kv_a_proj_with_mqa.weight", 512 + 64, d), _p(prefix + "kv_a_layernorm.weight", 512),
        _p(prefix + "kv_b_proj.weight", 128 * 256, 512),
        _p(prefix + "o_proj.weight", d, 128 * 128),
    ]


def deepseek_v3(n_layer: int = 61, d: int = 7168, dense_layers: int = 3, dense_ffn: int = 18432,
                n_experts: int = 256, expert_ffn: int = 2048, vocab: int = 129280) -> list[ParamSpec]:
    specs = [_p("model.embed_tokens.weight", vocab, d)]
    for i in range(n_layer):
        b = f"model.layers.{i}."
        specs += _mla(b + "self_attn.", d)
        if i < dense_layers:
            specs += _swiglu(b + "mlp.", d, dense_ffn)
        else:
            for e in range(n_experts):
                specs += _swiglu(f"{b}mlp.experts.{e}.", d, expert_ffn, expert=True)
            specs.append(_p(b + "mlp.gate.weight", n_experts, d))
            specs += _swiglu(b + "mlp.shared_experts.", d, expert_ffn)
        specs += [_p(b + "input_layernorm.weight", d), _p(b + "post_attention_layernorm.weight", d)]
    return specs + [_p("model.norm.weight", d), _p("lm_head.weight", vocab, d)]


# --- the catalogue -----------------------------------------------------------------------------

_HEAD = frozenset({"lm_head.weight", "model.embed_tokens.weight"})

_BUILDERS: dict[str, Callable[[], ModelShapes]] = {
    "gpt2-124m": lambda: ModelShapes(
        "gpt2-124m", tuple(gpt2(12, 768)), frozenset({"transformer.wte.weight", "transformer.wpe.weight"}),
        124_439_808, "GPT-2 small (HF gpt2, vocab 50257, head tied): 124,439,808"),
    "gpt2-1.5b": lambda: ModelShapes(
        "gpt2-1.5b", tuple(gpt2(48, 1600)), frozenset({"transformer.wte.weight", "transformer.wpe.weight"}),
        1_557_611_200, "GPT-2 XL (HF gpt2-xl, head tied): 1,557,611,200"),
    "llama3-8b": lambda: ModelShapes(
        "llama3-8b", tuple(llama(32, 4096, 14336, 32)), _HEAD, 8_030_261_248,
        "Meta-Llama-3-8B model card: 8.03B (config: 32 layers, 4096, ffn 14336, 32/8 heads)"),
    "llama3-70b": lambda: ModelShapes(
        "llama3-70b", tuple(llama(80, 8192, 28672, 64)), _HEAD, 70_553_706_496,
        "Meta-Llama-3-70B model card: 70.6B (config: 80 layers, 8192, ffn 28672, 64/8 heads)"),
    "mixtral-8x7b": lambda: ModelShapes(
        "mixtral-8x7b", tuple(mixtral()), _HEAD, 46_702_792_704,
        "Mixtral-8x7B: 46.7B total (32 layers, 4096, ffn 14336, 8 experts, vocab 32000)"),
    "deepseek-v3": lambda: ModelShapes(
        "deepseek-v3", tuple(deepseek_v3()), _HEAD, 671_000_000_000,
        "DeepSeek-V3 report: 671B total without the MTP module (61 layers, 7168, 256+1 experts)"),
}

MODELS: tuple[str, ...] = tuple(_BUILDERS)


def model_shapes(name: str) -> ModelShapes:
    """The shapes of model ``name``, one of :data:`MODELS`."""
    if name not in _BUILDERS:
        raise ValueError(f"model={name!r} is unknown; pass one of {', '.join(MODELS)}.")
    return _BUILDERS[name]()


def _main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.harness import markdown_table

    rows = []
    for name in MODELS:
        m = model_shapes(name)
        experts = sum(s.kind == "expert" for s in m.specs)
        rows.append([name, f"{m.numel:,}", f"{m.published:,}", f"{m.numel / m.published:.4f}", f"{len(m.specs):,}",
                     f"{m.muon_matrices:,}", f"{experts:,}"])
    print(markdown_table(["model", "params", "published", "ratio", "tensors", "Muon matrices", "expert tensors"],
                         rows))
    print("\nlargest tensor share: " + ", ".join(
        f"{n} {max(s.numel for s in model_shapes(n).specs) / model_shapes(n).numel:.2%}" for n in MODELS))


if __name__ == "__main__":
    _main()
