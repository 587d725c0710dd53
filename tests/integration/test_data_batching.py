"""Token rows: packing and padding shapes and counts, chat masks through build_datasets, collate, determinism."""

import json

import pytest
import torch
from torch.utils.data import DataLoader

from draftheads.data.batching import build_datasets, collate
from draftheads.data.config import DataConfig, DataError, DataWarning
from tests.chat_tokenizers import chatml_tokenizer, plain_tokenizer
from tests.unit.test_data_chat import CONVERSATION, masked_runs

DOCS = [f"def f{i}(x):\n    return x + {i}\n" * (1 + i % 4) for i in range(12)]


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer()


def text_file(tmp_path, docs=DOCS):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def test_packing_shapes_and_counts(tmp_path, tok):  # data.packing=stream (best_fit: tests/unit/test_best_fit_packing)
    cfg = DataConfig(source=text_file(tmp_path), seq_len=32, eval_rows=2, packing="stream")
    train, heldout = build_datasets(cfg, tok, seed=0)
    # Every training document, each followed by EOS, laid end to end; only the last row is padded.
    train_docs = DOCS[:-2]
    n_tokens = sum(len(tok(d)["input_ids"]) + 1 for d in train_docs)
    assert len(train) == -(-n_tokens // 32)
    batch = collate([train[i] for i in range(len(train))])
    assert all(v.shape == (len(train), 32) and v.dtype == torch.long for v in batch.values())
    assert int(batch["attention_mask"].sum()) == n_tokens
    assert torch.equal(batch["loss_mask"], batch["attention_mask"])  # text: every real token is a target
    flat = batch["input_ids"].reshape(-1)[:n_tokens]
    assert int((flat == tok.eos_token_id).sum()) == len(train_docs)
    assert sorted(tok.decode(flat).split("<|endoftext|>")[:-1]) == sorted(train_docs)
    assert batch["attention_mask"][:-1].all()  # no padding before the last row
    held = collate([heldout[i] for i in range(len(heldout))])
    assert tok.decode(held["input_ids"][held["attention_mask"].bool()]) == "<|endoftext|>".join(DOCS[-2:]) + \
        "<|endoftext|>"
    # data.document_mask (the default): positions restart after every EOS and at every row's start, count up by
    # one inside a document, and restart for the last row's padding (in the rows; a batch joins the padding to the
    # last document, `join_padding`)
    pos, ids = train[:]["position_ids"].long(), batch["input_ids"]
    for r in range(len(train)):
        for t in range(32):
            real = bool(batch["attention_mask"][r, t])
            starts = t == 0 or (real and ids[r, t - 1] == tok.eos_token_id) or (real != bool(
                batch["attention_mask"][r, t - 1]))
            assert int(pos[r, t]) == (0 if starts else int(pos[r, t - 1]) + 1), (r, t)
    real = batch["attention_mask"].bool()
    assert torch.equal(batch["position_ids"][real], pos[real])
    last = int(real[-1].sum())
    first = int(pos[-1, last - 1]) + 1  # the padding counts on from the last real token
    assert batch["position_ids"][-1, last:].tolist() == list(range(first, first + 32 - last))
    # data.document_mask=false: the same rows, numbered 0..T-1 (documents attend across the EOS between them)
    across, _ = build_datasets(DataConfig(source=text_file(tmp_path), seq_len=32, eval_rows=2, document_mask=False,
                                          packing="stream"), tok, seed=0)
    assert torch.equal(across[:]["input_ids"], train[:]["input_ids"])
    assert (across[:]["position_ids"] == torch.arange(32)).all()


def test_padding_shapes_truncation_count_and_strict(tmp_path, tok):
    docs = ["x = 1\n", "y = 2\n" * 40, "z = 3\n"]
    cfg = DataConfig(source=text_file(tmp_path, docs), seq_len=16, pack=False, eval_rows=0)
    with pytest.warns(DataWarning, match=r"truncated 1 of 3 rows longer than data.seq_len=16 \(first: .*docs.jsonl:2"):
        train, heldout = build_datasets(cfg, tok, seed=0)
    assert len(train) == 3 and len(heldout) == 0
    batch = collate([train[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, 16)
    lengths = sorted(batch["attention_mask"].sum(1).tolist())
    assert lengths == [len(tok("x = 1\n")["input_ids"]) + 1, len(tok("z = 3\n")["input_ids"]) + 1, 16]
    padded = batch["attention_mask"] == 0
    assert (batch["input_ids"][padded] == tok.pad_token_id).all() and (batch["loss_mask"][padded] == 0).all()
    assert (batch["position_ids"] == torch.arange(16)).all()  # one document a row
    # right padding: once padding starts it does not stop
    assert (batch["attention_mask"].diff(dim=1) <= 0).all()
    strict = DataConfig(source=cfg.source, seq_len=16, pack=False, eval_rows=0, strict=True)
    with pytest.raises(DataError, match=r"docs.jsonl:2: \d+ tokens, longer than data.seq_len=16"):
        build_datasets(strict, tok)


def chat_file(tmp_path, rows):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("pack", [True, False])
def test_chat_rows_mask_only_assistant_turns(tmp_path, tok, pack):
    cfg = DataConfig(source=chat_file(tmp_path, [CONVERSATION] * 3), seq_len=160, pack=pack, eval_rows=1)
    train, _ = build_datasets(cfg, tok, seed=0)
    batch = collate([train[i] for i in range(len(train))])
    runs = []
    for ids, mask in zip(batch["input_ids"].tolist(), batch["loss_mask"].tolist()):
        runs += masked_runs(tok, ids, mask)
    answers = [m["content"] + "<|im_end|>" for m in CONVERSATION if m["role"] == "assistant"]
    if pack:  # a run may be cut at a row boundary; the masked text as a whole is exactly the answers
        assert "".join(runs) == "".join(answers * 2)
    else:
        assert runs == answers * 2
    assert not (batch["loss_mask"].bool() & ~batch["attention_mask"].bool()).any()


def test_chat_source_with_tokenizer_without_template_names_the_option(tmp_path):
    cfg = DataConfig(source=chat_file(tmp_path, [CONVERSATION] * 2), eval_rows=0)
    with pytest.raises(DataError, match=r"chat.jsonl' holds chat rows but the tokenizer .* no chat template; "
                                        r"set data.chat_template"):
        build_datasets(cfg, plain_tokenizer())
    cfg = DataConfig(source=cfg.source, eval_rows=0, chat_template="chatml")
    train, _ = build_datasets(cfg, plain_tokenizer())
    assert int(train[0]["loss_mask"].sum()) > 0


def test_unusable_conversations_are_counted_then_empty_is_an_error(tmp_path, tok):
    no_answer = [{"role": "user", "content": "hi"}]
    cfg = DataConfig(source=chat_file(tmp_path, [CONVERSATION, no_answer, CONVERSATION]), eval_rows=0)
    with pytest.warns(DataWarning, match=r"skipped 1 of 3 rows \(unusable conversations\): 1 no assistant turn"):
        build_datasets(cfg, tok)
    cfg = DataConfig(source=chat_file(tmp_path, [no_answer, no_answer]), eval_rows=0)
    with pytest.raises(DataError, match="no usable rows after tokenising: 2 no assistant turn"):
        build_datasets(cfg, tok)


def test_deterministic_for_a_seed_and_loader_ready(tmp_path, tok):
    cfg = DataConfig(source=text_file(tmp_path), seq_len=16, eval_rows=0)
    a, _ = build_datasets(cfg, tok, seed=3)
    b, _ = build_datasets(cfg, tok, seed=3)
    c, _ = build_datasets(cfg, tok, seed=4)
    assert torch.equal(a[:]["input_ids"], b[:]["input_ids"])
    assert not torch.equal(a[:]["input_ids"], c[:]["input_ids"])
    loader = DataLoader(a, batch_size=4, shuffle=False, collate_fn=collate)
    first = next(iter(loader))
    assert set(first) == {"input_ids", "attention_mask", "loss_mask", "position_ids"}
    assert first["input_ids"].shape == (4, 16) and first["input_ids"].dtype == torch.long


def test_stdlib_default_builds(tok):
    train, heldout = build_datasets(DataConfig(seq_len=64, max_rows=4, eval_rows=2), tok, seed=0)
    assert len(train) > 0 and len(heldout) > 0
    assert train[0]["input_ids"].shape == (64,)
