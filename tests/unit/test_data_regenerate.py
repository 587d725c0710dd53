"""Regeneration with a tiny random verifier: CLI round trip (chat and text), batching equals one-by-one."""

import json
from collections import Counter

import pytest

from draftheads.data.config import DataError
from draftheads.data.sources import load_source
from draftheads.train.regenerate import load_for_generation, main, regenerate
from tests.chat_tokenizers import chatml_tokenizer
from tests.unit.test_data_chat import CONVERSATION
from tests.utils import save_tiny_verifier


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    """A random tiny Llama whose vocabulary is our test tokenizer's, saved with that tokenizer."""
    tok = chatml_tokenizer()
    folder = save_tiny_verifier(tmp_path_factory.mktemp("regen") / "verifier", "llama", vocab_size=len(tok),
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save_pretrained(folder)
    return folder


def chats(tmp_path):
    two_turns = [{"role": "user", "content": "What does a generator do?"},
                 {"role": "assistant", "content": "old answer"},
                 {"role": "user", "content": "And a list?"}]  # ends on a user turn: it gets an answer too
    rows = [CONVERSATION, two_turns, [{"role": "user", "content": "Hi"}]]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return path, rows


def test_chat_round_trip_through_the_cli(tmp_path, verifier_dir, capsys):
    source, rows = chats(tmp_path)
    out = tmp_path / "regen" / "out.jsonl"
    main(["--verifier", str(verifier_dir), "--source", str(source), "--out", str(out), "--max-new-tokens", "8",
          "--batch-size", "2", "--temperature", "0.8", "--seed", "1"])
    assert "wrote 3 rows" in capsys.readouterr().out
    back = load_source(str(out))  # reads back as a source, in OpenAI shape
    assert len(back) == 3
    for original, new in zip(rows, back["messages"]):
        kept = [m for m in original if m["role"] != "assistant"]
        assert [m for m in new if m["role"] != "assistant"] == kept  # system and user turns unchanged
        roles = [m["role"] for m in new]
        assert roles.count("assistant") == roles.count("user")  # one fresh answer per user turn
        assert all(roles[i + 1] == "assistant" for i, r in enumerate(roles) if r == "user")
        assert "old answer" not in [m["content"] for m in new]
    assert not list(out.parent.glob("*.tmp"))


def test_text_continuations(tmp_path, verifier_dir):
    (tmp_path / "code").mkdir()
    for i in range(3):
        (tmp_path / "code" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 5)
    out = tmp_path / "text.jsonl"
    main(["--verifier", str(verifier_dir), "--source", str(tmp_path / "code"), "--out", str(out),
          "--max-new-tokens", "8", "--prefix-tokens", "6", "--num-rows", "2"])
    back = load_source(str(out))
    assert back.column_names == ["text", "origin"] and len(back) == 2
    tok = chatml_tokenizer()
    prefix = tok.decode(tok("def f0(x):\n    return x * 0\n")["input_ids"][:6])
    assert back[0]["text"].startswith(prefix) and len(back[0]["text"]) > len(prefix)


def test_batched_greedy_equals_one_at_a_time(tmp_path, verifier_dir):
    model, tok = load_for_generation(verifier_dir, device="cpu")
    _, rows = chats(tmp_path)
    rows = [{"messages": r} for r in rows]
    batched = list(regenerate(model, tok, rows, max_new_tokens=6, batch_size=3, progress=False))
    single = list(regenerate(model, tok, rows, max_new_tokens=6, batch_size=1, progress=False))
    assert batched == single  # left padding changes nothing


def test_rows_without_user_turn_are_counted_and_bad_verifier_is_an_error(tmp_path, verifier_dir):
    model, tok = load_for_generation(verifier_dir, device="cpu")
    stats = Counter()
    rows = [{"messages": [{"role": "system", "content": "Be brief."}]}]
    assert list(regenerate(model, tok, rows, max_new_tokens=4, progress=False, stats=stats)) == []
    assert stats["skipped: no answer generated"] == 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no config.json"):
        load_for_generation(tmp_path / "empty")
    with pytest.raises(SystemExit, match="no such file or folder"):
        main(["--verifier", str(verifier_dir), "--source", str(tmp_path / "nope.jsonl"), "--out",
              str(tmp_path / "o.jsonl")])


def test_backend_flags_and_a_missing_vllm_are_one_line(tmp_path, verifier_dir, capsys, monkeypatch):
    import draftheads.eval.interop.vllm_peer as peer

    source, _ = chats(tmp_path)
    base = ["--verifier", str(verifier_dir), "--source", str(source), "--out", str(tmp_path / "out.jsonl")]
    for extra, says in ((["--backend", "vllm", "--device", "cpu"], "--device is the hf backend's"),
                        (["--tensor-parallel-size", "2"], "are the vllm backend's")):
        with pytest.raises(SystemExit) as exit:
            main([*base, *extra])
        assert exit.value.code == 2 and says in capsys.readouterr().err
    monkeypatch.delenv("DRAFTHEADS_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(peer, "ROOT", tmp_path / "no-checkout")  # no .venv-vllm, and this venv has no vllm
    with pytest.raises(SystemExit, match=r"^error: vLLM is not installed: run `bash scripts/setup_vllm.sh`"):
        main([*base, "--backend", "vllm"])
    assert not (tmp_path / "out.jsonl").exists()
    # an output that cannot be written: said before anything is loaded
    with pytest.raises(SystemExit, match=r"^error: --out .*/nope/out.jsonl: cannot write \(Not a directory"):
        main([*base[:4], "--out", str(source / "nope" / "out.jsonl"), "--backend", "vllm"])
    with pytest.raises(SystemExit, match=r"^error: --out .* is a folder; expected a .jsonl file path"):
        main([*base[:4], "--out", str(tmp_path), "--backend", "vllm"])
