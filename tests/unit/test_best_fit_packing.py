"""Best-fit packing (data.packing=best_fit, the default): whole documents per row, against a slow reference written
from the rule's words, and the rows build_datasets makes from it."""

import json

import numpy as np
import pytest
import torch

from draftheads.data.batching import best_fit_rows, build_datasets, pack_stats
from draftheads.data.config import DataConfig
from tests.chat_tokenizers import chatml_tokenizer


def slow_best_fit(lengths, seq_len):
    """Longest piece first (ties: lower index), into the open row with the least room that holds it (ties: the row
    opened first), else a new row; rows ordered by their lowest piece."""
    rows, rooms = [], []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        fits = [(rooms[r], r) for r in range(len(rows)) if rooms[r] >= lengths[i]]
        if fits:
            _, r = min(fits)
        else:
            r = len(rows)
            rows.append([])
            rooms.append(seq_len)
        rows[r].append(i)
        rooms[r] -= lengths[i]
    return sorted(rows, key=min)


@pytest.mark.parametrize("seed", range(4))
def test_best_fit_rows_is_the_rule(seed):
    rng = np.random.default_rng(seed)
    seq_len = int(rng.integers(8, 64))
    lengths = rng.integers(1, seq_len + 1, size=int(rng.integers(1, 200)))
    rows = best_fit_rows(lengths, seq_len)
    assert rows == slow_best_fit(lengths.tolist(), seq_len)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))  # every piece once
    assert all(lengths[row].sum() <= seq_len for row in rows)


def test_best_fit_fills_where_the_stream_order_would_not():
    # 6+4 and 5+3+2 fill two rows of 10 exactly; laid in this order, first fit would need three
    assert best_fit_rows(np.array([6, 5, 4, 3, 2]), 10) == [[0, 2], [1, 3, 4]]


def test_build_datasets_keeps_every_document_whole(tmp_path):
    tok = chatml_tokenizer()
    docs = [f"def f{i}(x):\n    return x + {i}\n" * (1 + i % 5) for i in range(14)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    seq_len = 40
    train, _ = build_datasets(DataConfig(source=str(path), seq_len=seq_len, eval_rows=0), tok, seed=0)
    ids, pos = train[:]["input_ids"], train[:]["position_ids"]
    attn, loss = train[:]["attention_mask"], train[:]["loss_mask"]
    assert torch.equal(loss, attn)  # text: every real token is a target, padding none
    # read the documents back from the positions: each restart begins one (padding is one more, not attended)
    found = []
    for r in range(len(train)):
        starts = [t for t in range(seq_len) if pos[r, t] == 0] + [seq_len]
        for a, b in zip(starts, starts[1:]):
            assert pos[r, a:b].tolist() == list(range(b - a))
            if attn[r, a]:
                assert attn[r, a:b].all()
                found.append(ids[r, a:b].tolist())
    whole = [tok(d)["input_ids"] + [tok.eos_token_id] for d in docs]
    pieces = [w[i: i + seq_len] for w in whole for i in range(0, len(w), seq_len)]  # longer ones cut in rows
    assert sorted(found) == sorted(pieces)
    assert any(len(w) > seq_len for w in whole) and any(len(w) < seq_len // 2 for w in whole)
    # no more rows than whole pieces need at best fit, and a row holds several short documents
    assert len(train) == len(best_fit_rows(np.array([len(p) for p in pieces]), seq_len))
    stats = pack_stats(train)
    assert stats["tokens"] == sum(map(len, pieces)) and stats["documents_per_row"] > 1
    # data.packing=stream: the same tokens end to end, cut wherever a row ends
    stream, _ = build_datasets(DataConfig(source=str(path), seq_len=seq_len, eval_rows=0, packing="stream"), tok,
                               seed=0)
    assert pack_stats(stream)["tokens"] == stats["tokens"] and len(stream) == -(-stats["tokens"] // seq_len)


def test_packing_is_checked():
    with pytest.raises(ValueError, match="data.packing='first_fit': expected 'best_fit' or 'stream'"):
        DataConfig(packing="first_fit")
