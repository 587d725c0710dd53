"""Sources: format detection, normalisation, the stdlib split, the hub code path, and bad input."""

import json
import warnings

import datasets
import pytest

from draftheads.data.config import DataConfig, DataError, DataWarning
from draftheads.data.sources import load_source, parse_hub, train_and_heldout
from draftheads.data.stdlib import split_of

SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                              {"from": "gpt", "value": "Hello!"}]}
OPENAI = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
NORMALISED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_sharegpt_and_openai_detected_and_normalised(tmp_path):
    share = load_source(str(write_jsonl(tmp_path / "s.jsonl", [SHAREGPT] * 3)))
    assert share.column_names == ["messages", "origin"] and len(share) == 3
    assert share[0]["messages"] == [{"role": "system", "content": "Be brief."}, *NORMALISED]
    assert share[1]["origin"] == f"{tmp_path / 's.jsonl'}:2"
    openai = load_source(str(write_jsonl(tmp_path / "o.jsonl", [OPENAI] * 2)))
    assert openai[0]["messages"] == NORMALISED
    # A .json file holding a list of rows (how ShareGPT dumps ship).
    (tmp_path / "list.json").write_text(json.dumps([SHAREGPT, OPENAI]))
    with pytest.warns(DataWarning, match=r"list.json row 1: no `messages` field"):
        listed = load_source(str(tmp_path / "list.json"), format="openai")  # forced: the ShareGPT row is skipped
    assert listed["messages"] == [NORMALISED] and listed["origin"] == [f"{tmp_path / 'list.json'} row 2"]


def test_text_rows_files_and_folders(tmp_path):
    texts = load_source(str(write_jsonl(tmp_path / "t.jsonl", [{"text": "a = 1\n"}, {"text": "b = 2\n"}])))
    assert texts.column_names == ["text", "origin"] and texts[1]["text"] == "b = 2\n"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "a.py").write_text("def f():\n    return 1\n")
    (tmp_path / "code" / "sub").mkdir()
    (tmp_path / "code" / "sub" / "b.txt").write_text("plain words\n")
    (tmp_path / "code" / "ignored.bin").write_bytes(b"\0\1")
    folder = load_source(str(tmp_path / "code"))
    assert folder["text"] == ["def f():\n    return 1\n", "plain words\n"]
    single = load_source(str(tmp_path / "code" / "a.py"))
    assert len(single) == 1 and single[0]["origin"].endswith("a.py")


def test_stdlib_uses_drafter_for_training_and_eval_for_heldout():
    train, heldout = train_and_heldout(DataConfig(eval_rows=5), seed=0)
    assert len(train) > 50 and len(heldout) == 5
    assert {split_of(o.removeprefix("stdlib:")) for o in train["origin"]} == {"drafter"}
    assert {split_of(o.removeprefix("stdlib:")) for o in heldout["origin"]} == {"eval"}
    few, none = train_and_heldout(DataConfig(max_rows=7, eval_rows=0), seed=1)
    assert len(few) == 7 and len(none) == 0
    assert few["origin"] != train["origin"][:7] and set(few["origin"]) < set(train["origin"])  # another order


def test_heldout_is_the_tail_of_other_sources(tmp_path):
    rows = [{"text": f"row {i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    train, heldout = train_and_heldout(DataConfig(source=str(path), eval_rows=3), seed=0)
    assert heldout["text"] == ["row 7", "row 8", "row 9"]
    assert sorted(train["text"]) == [f"row {i}" for i in range(7)]
    with pytest.raises(DataError, match="data.eval_rows=10 leaves no training rows"):
        train_and_heldout(DataConfig(source=str(path), eval_rows=10))


def test_hub_code_path_with_a_local_dataset_folder(tmp_path, monkeypatch):
    # `hf:` goes through datasets.load_dataset for real; a local folder of data files stands in for the hub.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "hubby"
    folder.mkdir()
    bad = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": None}]}
    write_jsonl(folder / "train.jsonl", [SHAREGPT, bad, SHAREGPT])
    with pytest.warns(DataWarning, match="skipped 1 of 3 rows.*non-string content.*row 2"):
        ds = load_source(f"hf:{folder}")
    assert len(ds) == 2 and ds[0]["messages"][1] == NORMALISED[0]
    assert parse_hub("hf:org/name:validation") == ("org/name", "validation")
    assert parse_hub("hf:org/name") == ("org/name", "train")
    with pytest.raises(DataError, match="could not load hub dataset 'nobody/nothing-here'"):
        load_source("hf:nobody/nothing-here")


# ---------------------------------------------------------------- bad input (issue 2 item 6, issue 8 catalogue)

MALFORMED = [
    ("missing field", {"conversation": []}),
    ("unknown role", {"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}),
    ("empty conversation", {"messages": []}),
    ("non-string content", {"messages": [{"role": "user", "content": ["a"]}]}),
    ("missing field", {"messages": [{"role": "user"}]}),
    ("invalid JSON", "{not json"),
    ("not an object", "[1, 2]"),
]


def test_malformed_rows_skipped_counted_with_one_warning(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [OPENAI] + [row for _, row in MALFORMED] + [OPENAI])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load_source(str(path))
    data_warnings = [w for w in caught if issubclass(w.category, DataWarning)]
    assert len(data_warnings) == 1
    message = str(data_warnings[0].message)
    assert f"skipped {len(MALFORMED)} of {len(MALFORMED) + 2} rows" in message
    for kind, _ in MALFORMED:
        assert kind in message
    assert "2 missing field" in message and f"{path}:2" in message  # first of the kind, by line
    assert len(ds) == 2


@pytest.mark.parametrize("kind, row", MALFORMED)
def test_strict_names_file_row_and_expectation(tmp_path, kind, row):
    path = write_jsonl(tmp_path / "chat.jsonl", [OPENAI, row])
    with pytest.raises(DataError) as info:
        load_source(str(path), strict=True)
    message = str(info.value)
    assert f"{path}:2:" in message and "data.strict=false" in message
    expected = {"unknown role": "expected one of system/user/assistant", "non-string content": "expected a string",
                "missing field": "lacks `role`/`content`" if "messages" in str(row) else "no `messages` field",
                "empty conversation": "no messages", "invalid JSON": "not valid JSON",
                "not an object": "expected a JSON object"}[kind]
    assert expected in message


def test_empty_dataset_after_filtering(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}, {"messages": [{"role": "bot", "content": "x"}]}])
    with pytest.raises(DataError, match=r"no usable rows \(all 2 rows were malformed: 1 empty conversation"):
        load_source(str(path))
    (tmp_path / "nothing.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no usable rows.*has no rows"):
        load_source(str(tmp_path / "nothing.jsonl"))


def test_missing_file_and_unknown_things(tmp_path):
    with pytest.raises(DataError, match=r"data.source='.*nope.jsonl': no such file or folder"):
        load_source(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_source(str(tmp_path / "x.csv"))
    path = write_jsonl(tmp_path / "odd.jsonl", [{"question": "?"}])
    with pytest.raises(DataError, match="cannot tell the row format.*question.*set data.format"):
        load_source(str(path))
    with pytest.raises(DataError, match="unknown stdlib split 'test'"):
        load_source("stdlib:test")
    (tmp_path / "obj.json").write_text('{"a": 1}')
    with pytest.raises(DataError, match="top level is a dict; expected a list"):
        load_source(str(tmp_path / "obj.json"))


def test_mixed_chat_and_text_folder_is_an_error(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [OPENAI])
    (tmp_path / "b.py").write_text("x = 1\n")
    with pytest.raises(DataError, match="mixes chat rows.*and text rows"):
        load_source(str(tmp_path))


def test_a_lone_surrogate_escape_is_a_skipped_row_or_a_strict_error(tmp_path):
    """`"\ud800"` in a JSON row is valid JSON but no UTF-8 text: the row is skipped with the data warning the other
    malformed rows get (Arrow's encoder raised a UnicodeEncodeError from inside datasets), or refused under strict,
    naming the row."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "def f(x):\\n    return x\\n"}\n{"text": "half a pair \\ud800 here"}\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load_source(str(path))
    message = " ".join(str(w.message) for w in caught if issubclass(w.category, DataWarning))
    assert len(ds) == 1 and "skipped 1 of 2 rows" in message and f"{path}:2" in message
    with pytest.raises(DataError, match=r"rows\.jsonl:2: a lone surrogate \\ud800 at character 12"):
        load_source(str(path), strict=True)
