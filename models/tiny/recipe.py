"""What an embedded verifier is: its `Recipe` (sizes, steps, data), the named recipes, the chat template."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Literal

#: Bumped whenever the build code changes what a recipe produces; part of the recorded recipe hash.
BUILDER_VERSION = 3  # 3: Muon orthogonalises in fp32 where bf16 is not native (models/muon.py)
BUILD_INFO = "draftheads_build.json"

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END)  # ids 0, 1, 2

#: ChatML. The assistant's content and its <|im_end|> sit in a generation block, so
#: `apply_chat_template(..., return_assistant_tokens_mask=True)` marks exactly those tokens (not the header, not the
#: newline after <|im_end|>).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: Pre-tokenizer split (GPT-4 style): words keep one leading space, digits go in threes, a newline run is a piece of
#: its own (so the "\n" ending a ChatML header never merges with the content after it), indentation is one piece.
PRETOKENIZE_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

Precision = Literal["auto", "bf16", "fp32"]


@dataclass(frozen=True)
class Recipe:
    """Everything that decides what a build produces (besides the seed). Its hash is recorded in the folder."""

    name: str
    """Folder name under $DRAFTHEADS_HOME (`tiny-code`, `tiny-micro`)."""
    vocab_size: int = 4096
    """BPE vocabulary size, the three special tokens included."""
    tokenizer_files: int | None = None
    """Train the tokenizer on the first N files of the `verifier` split (sorted); None: all of them."""
    train_files: int | None = None
    """Train the model on the first N files of the `verifier` split; None: all of them."""
    eval_files: int | None = None
    """Held-out bits per byte over the first N files of the `eval` split; None: all of them, 0: skip."""
    hidden_size: int = 256
    """Model width H."""
    intermediate_size: int = 768
    """SwiGLU MLP width."""
    num_layers: int = 8
    """Decoder layers; >= 4 so EAGLE-3's feature layers 2, L//2, L-3 exist (distinct from 7 layers on)."""
    num_heads: int = 4
    """Attention heads (head_dim = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Key/value heads; fewer than num_heads (GQA) like the real models drafters are trained for."""
    seq_len: int = 512
    """Training context: packed windows of this many tokens."""
    max_position_embeddings: int = 2048
    """Recorded in config.json; generation past seq_len works but was not trained on."""
    rope_theta: float = 10000.0
    """RoPE base."""
    init_std: float = 0.02
    """Normal init std of every matrix (config.initializer_range)."""
    scaled_residual_init: bool = True
    """GPT-2 style: o_proj and down_proj start at init_std / sqrt(2 * num_layers), so the residual stream's scale
    does not grow with depth."""
    batch_size: int = 8
    """Packed windows per optimizer step."""
    steps: int = 900
    """Optimizer steps (the budget is steps, never wall-clock, so builds are reproducible)."""
    optimizer: Literal["adamw", "muon"] = "muon"
    """adamw: AdamW everywhere. muon: Muon on the decoder layers' matrices, AdamW on embeddings, lm_head, norms."""
    lr: float = 2e-3
    """Peak learning rate (Muon's update is scaled to AdamW's RMS, so the same value serves both)."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at the last step."""
    warmup_steps: int = 50
    """Linear warmup from ~0 to lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (not on norms)."""
    beta2: float = 0.95
    """AdamW beta2 (beta1 is 0.9); Muon's momentum is 0.95 (Nesterov)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    precision: Precision = "auto"
    """Training autocast: auto = bf16 where the CPU (or the GPU of `--device cuda`) has native bf16 matmuls, else
    fp32. Weights stay fp32."""
    eval_batch_size: int = 8
    """Windows per forward when measuring held-out bits per byte."""

    def __post_init__(self):
        if self.num_layers < 4:
            raise ValueError(f"recipe {self.name!r}: num_layers={self.num_layers}; EAGLE-3 needs >= 4")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"recipe {self.name!r}: hidden_size={self.hidden_size}, num_heads={self.num_heads}, "
                             f"num_kv_heads={self.num_kv_heads} do not divide")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"recipe {self.name!r}: vocab_size={self.vocab_size} is below the 256 bytes + specials")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"recipe {self.name!r}: warmup_steps={self.warmup_steps} must be in [0, steps)")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"recipe {self.name!r}: optimizer={self.optimizer!r}; expected adamw or muon")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"recipe {self.name!r}: precision={self.precision!r}; expected auto, bf16 or fp32")

    def digest(self) -> str:
        """Hash of the recipe and the builder version: a cached folder with another digest is rebuilt."""
        blob = json.dumps({"builder": BUILDER_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


RECIPES: dict[str, Recipe] = {
    # ~12.5 minutes on 2 quiet CPU cores with native bf16 (see README for the measured figures)
    "default": Recipe(name="tiny-code"),
    # for tests: Python-looking greedy text in well under a minute
    "micro": Recipe(
        name="tiny-micro", vocab_size=1024, tokenizer_files=80, eval_files=4, hidden_size=128,
        intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=128, batch_size=8, steps=300,
        lr=5e-3, warmup_steps=20,
    ),
    # for a lent GPU (`--device cuda`; scripts/gpu_check.sh --realistic): 100.7M parameters, GPT-2-small-like
    # shapes with GQA and a 16k vocabulary, so a decode benchmark sees a verifier whose forward costs what a small
    # real model's does; 800 steps of 32 x 512 tokens (13.1M tokens: about 7 passes over the 1.8M tokens of the
    # stdlib's verifier split on Python 3.11). On two CPU cores it would take about a day (146 tokens/s measured).
    "code-100m": Recipe(
        name="code-100m", vocab_size=16384, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
        num_kv_heads=4, seq_len=512, batch_size=32, steps=800, lr=1e-3, warmup_steps=50, eval_batch_size=32,
    ),
}


def get_recipe(recipe: str | Recipe, **overrides) -> Recipe:
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise ValueError(f"unknown tiny verifier recipe {recipe!r}; expected one of {sorted(RECIPES)}")
        recipe = RECIPES[recipe]
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Recipe)}
    if unknown:
        raise ValueError(f"unknown recipe field(s) {sorted(unknown)}; see draftheads.models.tiny.Recipe")
    return dataclasses.replace(recipe, **overrides) if overrides else recipe
