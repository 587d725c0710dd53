"""Small fast byte-level BPE tokenizers for the data tests, each with a different chat template.

One BPE (about 500 tokens) is trained once on a few hundred lines of stdlib source and English sentences with the
special tokens of three template families; each builder wraps it with that family's special tokens and template:
ChatML (Qwen style), Llama-3 style and Mistral style, none with `{% generation %}` markers.
"""

from __future__ import annotations

from functools import lru_cache

from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
            "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<s>", "</s>", "[INST]", "[/INST]"]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Mistral style: the system prompt folded into the first user turn, `</s>` closes each assistant turn.
MISTRAL = (
    "{{ bos_token }}"
    "{% set system = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') | list %}"
    "{% for message in messages | rejectattr('role', 'equalto', 'system') %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first and system %}{{ '[INST] ' + system[0] + '\n\n' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)

_SENTENCES = [
    "How do I reverse a list in Python?", "Use slicing or the reversed builtin.",
    "You are a helpful coding assistant.", "Thanks, and how do I sort it?", "Call sorted on it.",
    "What does a generator do?", "It yields values lazily, one at a time.", "Write a function that adds two numbers.",
    "The quick brown fox jumps over the lazy dog.", "Please explain what a dictionary is.",
]


def _corpus() -> list[str]:
    from draftheads.data.stdlib import read_source, stdlib_files

    lines = []
    for path in stdlib_files("eval")[:3]:
        lines += read_source(path).splitlines()[:150]
    return lines + _SENTENCES * 10


@lru_cache(maxsize=1)
def _bpe_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_corpus(), trainer)
    return bpe.to_str()


def _wrap(template: str | None, **special) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_bpe_json()), **special)
    tok.chat_template = template
    return tok


def chatml_tokenizer() -> PreTrainedTokenizerFast:
    return _wrap(CHATML, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def llama3_tokenizer() -> PreTrainedTokenizerFast:
    return _wrap(LLAMA3, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def mistral_tokenizer() -> PreTrainedTokenizerFast:
    return _wrap(MISTRAL, bos_token="<s>", eos_token="</s>")


def plain_tokenizer() -> PreTrainedTokenizerFast:
    """No chat template at all (a base model's tokenizer)."""
    return _wrap(None, eos_token="<|endoftext|>")


TOKENIZERS = {"chatml": chatml_tokenizer, "llama3": llama3_tokenizer, "mistral": mistral_tokenizer}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>"}
