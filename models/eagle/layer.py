"""The drafter's decoder layer: which family's layer class, its config from the verifier's, its norms."""

from __future__ import annotations

import copy

import torch
from torch import nn

#: Verifier families whose own decoder layer the drafter copies; every other family gets a Llama layer with its dims
#: (`llama_layer_config`), which is also what the engines build for them.
OWN_LAYER_FAMILIES = ("llama", "qwen2", "mistral")

# ---- the drafter -------------------------------------------------------------------------------------------------
def _family(model_type: str):
    """(DecoderLayer, RMSNorm, RotaryEmbedding, apply_rotary_pos_emb) of the drafter's layer: the verifier's own for
    the families in `OWN_LAYER_FAMILIES`, a Llama layer for every other family."""
    if model_type == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as m

        return m.Qwen2DecoderLayer, m.Qwen2RMSNorm, m.Qwen2RotaryEmbedding, m.apply_rotary_pos_emb
    if model_type == "mistral":
        from transformers.models.mistral import modeling_mistral as m

        return m.MistralDecoderLayer, m.MistralRMSNorm, m.MistralRotaryEmbedding, m.apply_rotary_pos_emb
    from transformers.models.llama import modeling_llama as m

    return m.LlamaDecoderLayer, m.LlamaRMSNorm, m.LlamaRotaryEmbedding, m.apply_rotary_pos_emb


def _layer_config(verifier_config):
    """The drafter layer's config: the verifier's config cut to one layer (its own families), or a one-layer Llama
    config with the verifier's dims, activation, norm eps and (global) rope for any other family."""
    if verifier_config.model_type in OWN_LAYER_FAMILIES:
        cfg = copy.deepcopy(verifier_config)
        cfg.num_hidden_layers = 1
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = ["full_attention"]
        return cfg
    return llama_layer_config(verifier_config)


def llama_layer_config(vc):
    """A one-layer LlamaConfig with the dims of verifier config `vc` (any family): what vLLM and SGLang build for an
    EAGLE drafter whatever the verifier (their EAGLE-3 class is Llama's for a Qwen3, Gemma 3 or Llama target).
    Kept from `vc`: hidden, intermediate, heads, kv heads, head_dim, activation, norm eps, positions, the rope of
    its full-attention layers, vocab and token ids; not kept: q/k norms (Qwen3, OLMo 2), sliding windows, Gemma's
    (1 + w) norms and embedding scale — the drafter layer is trained, not copied."""
    from transformers import LlamaConfig

    heads = vc.num_attention_heads
    rope = dict(getattr(vc, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3): the global layers' rope
        rope = dict(rope["full_attention"])
    if not rope:
        rope = {"rope_type": "default", "rope_theta": getattr(vc, "rope_theta", 10000.0)}
    return LlamaConfig(
        vocab_size=vc.vocab_size, hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(vc, "num_key_value_heads", None) or heads,
        head_dim=getattr(vc, "head_dim", None) or vc.hidden_size // heads,
        hidden_act=getattr(vc, "hidden_act", None) or getattr(vc, "hidden_activation", None) or "silu",
        rms_norm_eps=getattr(vc, "rms_norm_eps", None) or 1e-6,
        max_position_embeddings=getattr(vc, "max_position_embeddings", 4096), rope_parameters=rope,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        bos_token_id=getattr(vc, "bos_token_id", None), eos_token_id=getattr(vc, "eos_token_id", None),
        pad_token_id=getattr(vc, "pad_token_id", None))


def norm_scale(norm: nn.Module, hidden_size: int) -> torch.Tensor:
    """The per-channel scale an RMS norm applies (x * w, or x * (1 + w) in Gemma's convention): its output for an
    input of RMS 1, times sqrt(1 + eps). Used to start the drafter's Llama norm from any family's final norm."""
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 0.0
    w = next(norm.parameters())
    with torch.no_grad():
        out = norm(torch.ones(1, hidden_size, dtype=w.dtype, device=w.device))[0].float()
    return (out * (1.0 + eps) ** 0.5).cpu()


def normal_init(modules, std: float) -> None:
    """transformers' `_init_weights` for the linear maps among `modules`: weights from normal(0, std), biases zero."""
    with torch.no_grad():
        for module in modules:
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()


class _Held:
    """Modules the drafter uses but does not own: not its parameters or state, untouched by `.to(dtype)`.

    embed_tokens and lm_head are the verifier's (frozen, shared); rotary_emb keeps its inverse frequencies in fp32.
    """

    def __init__(self, **modules: nn.Module):
        self.__dict__.update(modules)
