"""The embedded verifier's byte-level BPE tokenizer, trained on the corpus it is built from."""

from __future__ import annotations

from draftheads.models.tiny.pretrain import _bar
from draftheads.models.tiny.recipe import CHAT_TEMPLATE, EOS, IM_END, IM_START, PRETOKENIZE_PATTERN, SPECIAL_TOKENS


# ---- tokenizer --------------------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int = 2048):
    """A byte-level BPE (Hugging Face fast tokenizer) with <|endoftext|>, <|im_start|>, <|im_end|> and ChatML."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_bar(texts, desc="training tokenizer", unit="file", leave=False), trainer,
                            length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=None, unk_token=None,
        additional_special_tokens=[IM_START, IM_END], model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
