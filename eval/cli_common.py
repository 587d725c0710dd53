"""What the eval commands share (`python -m eval`, `python -m eval tune`): the usage error, the verifier's tokenizer,
prompts encoded and checked against the verifier's context."""

from __future__ import annotations


class UsageError(ValueError):
    """A command line that cannot run; the message says which flag to fix."""


def load_tokenizer(verifier, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    folder = verifier.path
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as err:  # no tokenizer files: say which folder
        raise UsageError(f"verifier folder {str(folder)!r} has no usable tokenizer ({type(err).__name__}: {err}); "
                         "the prompts are text, so the verifier folder needs its tokenizer files") from None


def encode_prompts(prompts, tokenizer, chat_template, max_positions: int | None, max_new_tokens: int):
    from data.prompts import prompt_ids

    encoded = []
    for p in prompts:
        ids = prompt_ids(p, tokenizer, chat_template)
        if not ids:
            raise UsageError(f"prompt {p.id!r} encodes to no tokens")
        if max_positions and len(ids) + max_new_tokens > max_positions:
            raise UsageError(f"prompt {p.id!r} has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that "
                             f"exceeds the verifier's max_position_embeddings={max_positions}")
        encoded.append((p.id, ids))
    return encoded
