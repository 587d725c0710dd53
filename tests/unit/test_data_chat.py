"""Assistant-only loss masks under ChatML, Llama-3 and Mistral style templates (no generation markers)."""

import numpy as np
import pytest

from draftheads.data.chat import (
    BUILTIN_TEMPLATES,
    Span,
    assistant_spans,
    end_of_turn_ids,
    resolve_chat_template,
    spans_to_mask,
    tokenize_chat,
    tokenize_chats,
)
from draftheads.data.config import DataError
from draftheads.data.sources import RowError
from tests.chat_tokenizers import END_OF_TURN, TOKENIZERS, chatml_tokenizer, plain_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are a helpful coding assistant."},
    {"role": "user", "content": "How do I reverse a list in Python?"},
    {"role": "assistant", "content": "Use slicing or the reversed builtin."},
    {"role": "user", "content": "Thanks, and how do I sort it?"},
    {"role": "assistant", "content": "Call sorted on it."},
    {"role": "user", "content": "What does a generator do?"},
    {"role": "assistant", "content": "It yields values lazily,\none at a time."},
]


def masked_runs(tokenizer, ids, mask) -> list[str]:
    """The decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


@pytest.mark.parametrize("family", sorted(TOKENIZERS))
def test_mask_is_exactly_assistant_content_and_end_of_turn(family):
    tok = TOKENIZERS[family]()
    out = tokenize_chat(CONVERSATION, tok)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    eot = END_OF_TURN[family]
    expected = [m["content"] + eot for m in CONVERSATION if m["role"] == "assistant"]
    runs = masked_runs(tok, ids, mask)
    # Mistral's template puts a space before the answer; a token holding it and the first word is masked (the
    # model must produce it), a lone space token is not.
    assert [r.lstrip(" ") for r in runs] == expected
    # Everything else (system, user turns, headers) is unmasked and complete.
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m])
    for m in CONVERSATION:
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    # The whole sequence is the template's rendering, token for token.
    assert tok.decode(ids) == tok.apply_chat_template(CONVERSATION, tokenize=False)


def test_chatml_newline_after_end_of_turn_is_not_masked():
    tok = chatml_tokenizer()
    out = tokenize_chat(CONVERSATION, tok)
    ids, mask = out["input_ids"], out["loss_mask"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ends = [i for i, t in enumerate(ids) if t == im_end]
    assert len(ends) == len(CONVERSATION)
    for i in ends:
        is_assistant = mask[i] == 1
        assert tok.decode([ids[i + 1]]) == "\n" and mask[i + 1] == 0
        if is_assistant:
            assert mask[i - 1] == 1  # the last content token
    assert sum(mask[i] for i in ends) == 3  # only the assistants' <|im_end|>


def test_llama3_template_trims_content_and_mask_follows():
    tok = TOKENIZERS["llama3"]()
    conv = [{"role": "user", "content": "  padded question \n"}, {"role": "assistant", "content": "\n answer. \n\n"}]
    out = tokenize_chat(conv, tok)
    assert masked_runs(tok, out["input_ids"], out["loss_mask"]) == ["answer.<|eot_id|>"]


def test_content_that_looks_like_template_text_is_found_at_its_own_turn():
    tok = chatml_tokenizer()
    conv = [{"role": "user", "content": "Say assistant"}, {"role": "assistant", "content": "assistant"},
            {"role": "user", "content": "assistant"}, {"role": "assistant", "content": "user"}]
    text, spans = assistant_spans(conv, tok, tok.chat_template)
    assert [text[s.start: s.content_end] for s in spans] == ["assistant", "user"]
    assert [text[s.content_end: s.end] for s in spans] == ["<|im_end|>", "<|im_end|>"]
    first_assistant_header = text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    assert spans[0].start == first_assistant_header
    out = tokenize_chat(conv, tok)
    assert masked_runs(tok, out["input_ids"], out["loss_mask"]) == ["assistant<|im_end|>", "user<|im_end|>"]


def test_template_that_rewrites_content_is_a_row_error():
    tok = chatml_tokenizer()
    upper = BUILTIN_TEMPLATES["chatml"].replace("message['content']", "message['content'] | upper")
    (result,) = tokenize_chats([CONVERSATION], tok, upper)
    assert isinstance(result, RowError) and "not rendered verbatim" in str(result)


def test_conversation_without_assistant_turn_is_a_row_error():
    tok = chatml_tokenizer()
    (result,) = tokenize_chats([[{"role": "user", "content": "hi"}]], tok, tok.chat_template)
    assert isinstance(result, RowError) and result.kind == "no assistant turn"


def test_missing_chat_template_names_the_option_and_builtin_fixes_it():
    tok = plain_tokenizer()
    with pytest.raises(DataError, match="data.chat_template"):
        resolve_chat_template(tok)
    out = tokenize_chat(CONVERSATION, tok, chat_template="chatml")
    assert masked_runs(tok, out["input_ids"], out["loss_mask"])[0] == "Use slicing or the reversed builtin.<|im_end|>"
    with pytest.raises(DataError, match="not a builtin template"):
        resolve_chat_template(tok, "no-such-template")


def test_template_from_a_jinja_file(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(BUILTIN_TEMPLATES["chatml"])
    assert resolve_chat_template(plain_tokenizer(), str(path)) == BUILTIN_TEMPLATES["chatml"]


def test_end_of_turn_ids():
    for family, make in TOKENIZERS.items():
        tok = make()
        ids = end_of_turn_ids(tok, tok.chat_template)
        assert tok.convert_ids_to_tokens(ids[0]) == END_OF_TURN[family]
        assert tok.eos_token_id in ids


def test_spans_to_mask_overlap_rule():
    offsets = np.array([[0, 3], [3, 5], [5, 9], [9, 9], [9, 12]])
    mask = spans_to_mask(offsets, [Span(4, 9, 9)])
    assert mask.tolist() == [0, 1, 1, 0, 0]  # token [3,5) overlaps the span start; zero-width at 9 is outside
    assert spans_to_mask(offsets, [Span(9, 10, 12)]).tolist() == [0, 0, 0, 1, 1]
