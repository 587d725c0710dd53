"""The embedded default verifier: a small Llama trained from scratch on the Python standard library's source.

No model hub is needed anywhere in draftheads: this module trains a byte-level BPE tokenizer and a Llama-architecture
causal LM on the stdlib's `verifier` split (see `data.stdlib`) and saves them as an ordinary Hugging Face model folder
(config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json, a ChatML chat
template) that `AutoModelForCausalLM` / `AutoTokenizer` / `Verifier.from_pretrained` load offline.

    draftheads build-verifier --recipe default|micro [--out DIR] [--seed N] [--force]
    python -m draftheads.models.tiny path  --recipe default      # print the cached folder, building it first if needed

`ensure_built("default")` is what `Verifier.from_pretrained("tiny-code")` calls: the folder lives in
`$DRAFTHEADS_HOME/<name>` (default `~/.cache/draftheads`), is built once under a file lock into a temp folder that is
renamed into place, and is rebuilt when the recipe (or this builder) changes.

A build is a fixed number of optimizer steps over a fixed data order from `torch.manual_seed(seed)`: the same seed on
the same machine (and thread count) gives the same bytes. Training uses bf16 autocast where the CPU multiplies bf16
natively (AVX512-BF16 / AMX; ~2.3x faster here) and fp32 elsewhere; the saved weights are always fp32. The
decoder's matrices train with Muon (torch.optim.Muon), the rest with AdamW: at equal steps Muon reached a held-out
loss ~0.5 nats/token lower than AdamW here, for ~10% more time per step.
"""

#: Public name -> the module of this package that defines it. Loaded on first use (PEP 562), so that
#: `python -m draftheads.models.tiny` can set OpenMP's wait policy before anything imports torch
#: (models/tiny/__main__.py).
_EXPORTS = {
    "BUILDER_VERSION": "recipe", "BUILD_INFO": "recipe", "CHAT_TEMPLATE": "recipe", "EOS": "recipe",
    "IM_END": "recipe", "IM_START": "recipe", "PRETOKENIZE_PATTERN": "recipe", "Precision": "recipe",
    "RECIPES": "recipe", "Recipe": "recipe", "SPECIAL_TOKENS": "recipe", "get_recipe": "recipe",
    "train_tokenizer": "tokenizer",
    "bits_per_byte": "pretrain", "compute_dtype": "pretrain", "eval_windows": "pretrain", "learning_rate": "pretrain",
    "make_optimizers": "pretrain", "model_config": "pretrain", "native_bf16": "pretrain",
    "pack_documents": "pretrain", "train_model": "pretrain", "training_batches": "pretrain",
    "build": "cache", "cache_home": "cache", "ensure_built": "cache", "is_current": "cache",
    "read_build_info": "cache",
    "greedy_generate": "cli", "main": "cli", "summary": "cli",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
