"""Chat rows to tokens with an assistant-only loss mask, for any chat template that writes content verbatim.

The mask is 1 exactly on what the model says: each assistant message's content tokens and the end-of-turn token
the template emits right after them (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama-3, `</s>` for Mistral);
0 on system/user turns, role headers and whatever follows the end-of-turn token (ChatML's newline).

How, without `{% generation %}` markers in the template:
  1. render the conversation twice: for real, and with each content replaced by a unique placeholder. The
     placeholder render splits the text into the template's own literal pieces around each message.
  2. walk the real text piece by piece; between two pieces sits one message's content, verbatim or trimmed
     (Llama-3 templates `| trim` it). That gives each assistant content's character span.
  3. extend each span over optional whitespace and the special token that follows it (the end-of-turn token).
  4. tokenize the real text with offset mappings (a fast tokenizer) and mark every token overlapping a span.
A template that rewrites content (beyond trimming) makes its rows fail with a RowError naming the message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from draftheads.data.config import BUILTIN_TEMPLATE_NAMES, DataError, chat_template_problem, template_file
from draftheads.data.sources import RowError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
_SPACE = re.compile(r"\s*")
#: Names accepted by `data.chat_template` besides a .jinja file or the template text.
BUILTIN_TEMPLATES = dict(zip(BUILTIN_TEMPLATE_NAMES, (CHATML_TEMPLATE, LLAMA3_TEMPLATE), strict=True))


@dataclass(frozen=True)
class Span:
    """Characters of one assistant turn in the rendered text: content [start, content_end), with the
    end-of-turn token [start, end)."""

    start: int
    content_end: int
    end: int


def resolve_chat_template(tokenizer, option: str | None = None, *, where: str = "the data",
                          option_name: str = "data.chat_template") -> str:
    """The chat template to use: `option` (a builtin name, a .jinja file or template text) or the tokenizer's own.

    Raises DataError naming `option_name` when neither exists.
    """
    if option is not None:
        problem = chat_template_problem(option, option_name)
        if problem:
            raise DataError(problem)
        if option in BUILTIN_TEMPLATES:
            return BUILTIN_TEMPLATES[option]
        path = template_file(option)
        return option if path is None else path.read_text(encoding="utf-8")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # tokenizers that carry several named templates
        template = template.get("default") or next(iter(template.values()), None)
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"{where} holds chat rows but the tokenizer ({name}) has no chat template; set "
                        f"{option_name} to {' or '.join(BUILTIN_TEMPLATES)}, a .jinja file or the template text")
    return template


def render_chat(messages: list[dict], tokenizer, template: str, add_generation_prompt: bool = False) -> str:
    """The conversation as the template writes it (a string; special tokens as text)."""
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _special_strings(tokenizer) -> list[str]:
    """Special token strings, longest first (so `<|eot_id|>` wins over a shorter prefix)."""
    found = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    found.update(getattr(tokenizer, "all_special_tokens", []))
    return sorted((s for s in found if s), key=len, reverse=True)


def _render(messages, tokenizer, template) -> str:
    try:
        return render_chat(messages, tokenizer, template)
    except Exception as e:  # jinja's raise_exception ("roles must alternate"), missing variables, ...
        raise RowError("rejected by chat template", f"the chat template failed: {type(e).__name__}: {e}") from e


def assistant_spans(messages: list[dict], tokenizer, template: str) -> tuple[str, list[Span]]:
    """The rendered conversation and the character span of each assistant turn; raises RowError."""
    text = _render(messages, tokenizer, template)
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    if any("\ue000" in m["content"] for m in messages):
        raise RowError("unsupported content", "content holds the private-use character U+E000")
    probe = _render([{**m, "content": mark} for m, mark in zip(messages, marks)], tokenizer, template)

    # Where each placeholder sits in the probe render; messages the template leaves out have none.
    placed = []
    for i, mark in enumerate(marks):
        at = probe.find(mark)
        if at >= 0:
            if probe.find(mark, at + 1) >= 0:
                raise RowError("template rewrites content", f"the chat template writes message {i} twice")
            placed.append((at, i))
        elif messages[i]["role"] == "assistant":
            raise RowError("template rewrites content", f"the chat template leaves out assistant message {i}")
    placed.sort()

    # Walk the real text: literal piece, content, literal piece, content, ..., final piece.
    pieces = [probe[: placed[0][0]] if placed else probe]
    for k, (at, i) in enumerate(placed):
        stop = placed[k + 1][0] if k + 1 < len(placed) else len(probe)
        pieces.append(probe[at + len(marks[i]): stop])
    if not text.startswith(pieces[0]):
        raise RowError("template rewrites content", "the chat template renders differently around the content")
    pos = len(pieces[0])
    content_at: dict[int, tuple[int, int]] = {}
    for k, (_, i) in enumerate(placed):
        content, after = messages[i]["content"], pieces[k + 1]
        for candidate in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
            if text.startswith(candidate, pos) and text.startswith(after, pos + len(candidate)):
                break
        else:
            raise RowError("template rewrites content",
                           f"message {i} ({messages[i]['role']}) is not rendered verbatim by the chat template")
        content_at[i] = (pos, pos + len(candidate))
        pos += len(candidate) + len(after)
    if pos != len(text):
        raise RowError("template rewrites content", "the chat template renders differently around the content")

    specials = _special_strings(tokenizer)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, content_end = content_at[i]
        after_space = _SPACE.match(text, content_end).end()  # Llama-2 style templates put " " before </s>
        tail = next((s for s in specials if text.startswith(s, after_space)), None)
        spans.append(Span(start, content_end, after_space + len(tail) if tail else content_end))
    return text, spans


def spans_to_mask(offsets: np.ndarray, spans: list[Span]) -> np.ndarray:
    """(T,) int8 mask: 1 on every token whose characters overlap an assistant span. offsets: (T, 2) char ranges."""
    starts = offsets[:, 0]
    ends = np.maximum(offsets[:, 1], starts + 1)  # zero-width tokens count at their position
    mask = np.zeros(len(offsets), dtype=np.int8)
    for s in spans:
        mask |= ((starts < s.end) & (ends > s.start)).astype(np.int8)
    return mask


def tokenize_chats(conversations: list[list[dict]], tokenizer, template: str
                   ) -> list[tuple[list[int], list[int]] | RowError]:
    """Each conversation as (input_ids, loss_mask), or the RowError that makes it unusable; one tokenizer call."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"the assistant-only loss mask needs a fast tokenizer (offset mappings); "
                        f"{type(tokenizer).__name__} is not one: load it with AutoTokenizer (use_fast=True)")
    rendered: list[tuple[str, list[Span]] | RowError] = []
    for messages in conversations:
        try:
            if not any(m["role"] == "assistant" for m in messages):
                raise RowError("no assistant turn", "the conversation has no assistant message to train on")
            rendered.append(assistant_spans(messages, tokenizer, template))
        except RowError as err:
            rendered.append(err)
    texts = [r[0] for r in rendered if not isinstance(r, RowError)]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False) if texts else None
    out: list[tuple[list[int], list[int]] | RowError] = []
    k = 0
    for r in rendered:
        if isinstance(r, RowError):
            out.append(r)
            continue
        ids, offsets = enc["input_ids"][k], np.asarray(enc["offset_mapping"][k], dtype=np.int64).reshape(-1, 2)
        k += 1
        out.append((ids, spans_to_mask(offsets, r[1]).tolist()))
    return out


def tokenize_chat(messages: list[dict], tokenizer, chat_template: str | None = None) -> dict[str, list[int]]:
    """One conversation as {"input_ids", "loss_mask"}; raises DataError when it cannot be used."""
    template = resolve_chat_template(tokenizer, chat_template)
    (result,) = tokenize_chats([messages], tokenizer, template)
    if isinstance(result, RowError):
        raise DataError(f"conversation: {result}")
    ids, mask = result
    return {"input_ids": ids, "loss_mask": mask}


def end_of_turn_ids(tokenizer, template: str) -> list[int]:
    """Token ids that end an assistant turn under this template (its end-of-turn token, and EOS)."""
    messages = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
    ids = []
    try:
        text, (span,) = assistant_spans(messages, tokenizer, template)
        marker = text[span.content_end: span.end].strip()
        if marker:
            ids.append(tokenizer.convert_tokens_to_ids(marker))
    except RowError:
        pass
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
