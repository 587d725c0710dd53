"""Tiny random verifiers of each supported family, saved as ordinary HF model folders."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "mistral")


def tiny_config(family: str = "llama", vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4,
                **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "mistral":
        return MistralConfig(sliding_window=None, **common)
    raise ValueError(f"unknown family {family!r}")


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()


def save_tiny_verifier(folder: str | Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random tiny causal LM written with safetensors, loadable by `Verifier.from_pretrained(folder)`."""
    folder = Path(folder)
    tiny_model(family, seed, **overrides).save_pretrained(folder, safe_serialization=True)
    return folder


def save_tiny_verifier_with_tokenizer(folder: str | Path, family: str = "llama", seed: int = 0,
                                      **overrides) -> Path:
    """A random tiny verifier and a small byte-level BPE tokenizer (tests/chat_tokenizers.py) in one folder, so
    `train.loop.load_verifier` (and any trainer) can use it as `verifier: <folder>`."""
    from tests.chat_tokenizers import plain_tokenizer

    tokenizer = plain_tokenizer()
    vocab = -(-len(tokenizer) // 64) * 64  # rounded up, as real vocabularies are
    overrides = {"vocab_size": vocab, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.eos_token_id,
                 **overrides}
    folder = save_tiny_verifier(folder, family, seed, **overrides)
    tokenizer.save_pretrained(folder)
    return folder
