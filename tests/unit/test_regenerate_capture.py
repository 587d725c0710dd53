"""What `regenerate --capture` checks before vLLM starts (train/regenerate_capture.py), and the padding a cache
records (data/hidden_states.py, train/vllm_backend.py)."""

import json
from types import SimpleNamespace

import pytest
import torch

from draftheads.data.hidden_states import FORMAT, VERSION, CacheError, read_index
from draftheads.models.outputs import kind_of
from draftheads.train.regenerate_capture import RECORD, check_config, earlier_record, new_record, setting_change
from draftheads.train.vllm_backend import documents


def config(verifier, source, dtype="float32"):
    return SimpleNamespace(verifier=str(verifier), verifier_dtype=dtype, data=SimpleNamespace(source=str(source)))


@pytest.fixture
def verifier(tmp_path):
    folder = tmp_path / "verifier"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_the_config_must_train_on_out_with_this_verifier_in_this_dtype(tmp_path, verifier):
    out = tmp_path / "regen.jsonl"
    check_config(config(verifier, out), verifier, out, "float32")
    with pytest.raises(CacheError, match=r"data.source='.*rows.jsonl' is not --out .*: add --data.source="):
        check_config(config(verifier, tmp_path / "rows.jsonl"), verifier, out, "float32")
    with pytest.raises(CacheError, match="verifier_dtype=bfloat16 but --dtype float32"):
        check_config(config(verifier, out, "bfloat16"), verifier, out, "float32")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "model.safetensors").write_bytes(b"")
    with pytest.raises(CacheError, match=r"--config: verifier='.*other' is not --verifier"):
        check_config(config(other, out), verifier, out, "float32")


SETTINGS = {"out": "/r.jsonl", "max_new_tokens": 24, "seed": 0, "dtype": "float32",
            "data": {"source": "/r.jsonl", "seq_len": 96, "document_mask": True, "seed": 0}}


def test_a_setting_that_differs_is_named_as_its_flag_or_config_key():
    assert setting_change(SETTINGS, SETTINGS) is None
    assert setting_change(SETTINGS, {**SETTINGS, "max_new_tokens": 8}) == \
        "--max-new-tokens 24, this run has --max-new-tokens 8"
    data = {**SETTINGS["data"], "document_mask": False}
    assert setting_change(SETTINGS, {**SETTINGS, "data": data}) == \
        "data.document_mask=True, this run has data.document_mask=False"
    assert setting_change(SETTINGS, {**SETTINGS, "data": {**SETTINGS["data"], "seed": 1}}).startswith("train.seed=0")


def test_the_record_is_kept_for_the_same_run_and_refuses_another(tmp_path):
    inputs = {"--verifier": {"source": "v", "files": {}, "digest": "aa"}}
    assert earlier_record(tmp_path, SETTINGS, inputs) is None
    record = new_record(SETTINGS, inputs)
    assert record["answered"] == {"rows": 0, "bytes": 0, "written": 0, "seed": 0, "skipped": {}}
    record["answered"]["rows"] = 4
    (tmp_path / RECORD).write_text(json.dumps(record))
    assert kind_of(tmp_path) == "cache"  # a folder mid-answering is a cache being made: a rerun may continue it
    assert earlier_record(tmp_path, SETTINGS, inputs)["answered"]["rows"] == 4
    with pytest.raises(CacheError, match="started with --dtype 'float32', this run has --dtype 'bfloat16'"):
        earlier_record(tmp_path, {**SETTINGS, "dtype": "bfloat16"}, inputs)
    with pytest.raises(CacheError, match=r"other inputs \(--verifier"):
        earlier_record(tmp_path, SETTINGS, {"--verifier": {"source": "v", "files": {}, "digest": "bb"}})
    (tmp_path / RECORD).write_text("{")
    with pytest.raises(CacheError, match="not valid JSON"):
        earlier_record(tmp_path, SETTINGS, inputs)


def test_zeros_padding_leaves_the_padding_out_of_the_requests():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8])
    assert documents(positions, mask, "zeros") == [[(0, 3), (3, 5), (5, 6)], [(0, 8)]]
    assert documents(positions, mask, "joined") == [[(0, 3), (3, 5), (5, 8)], [(0, 8)]]
    with pytest.raises(CacheError, match="padding='left'"):
        documents(positions, mask, "left")


def test_a_cache_reads_with_either_padding_and_without_one(tmp_path):
    for padding in ("zeros", "joined", None):
        index = {"format": FORMAT, "version": VERSION, **({"padding": padding} if padding else {})}
        (tmp_path / "index.json").write_text(json.dumps(index))
        assert read_index(tmp_path)["padding"] == (padding or "joined")
    (tmp_path / "index.json").write_text(json.dumps({"format": FORMAT, "version": VERSION, "padding": "left"}))
    with pytest.raises(CacheError, match="padding='left'; expected one of"):
        read_index(tmp_path)


def test_capture_flags_without_capture_and_capture_without_vllm_are_usage_errors(capsys):
    from draftheads.train.regenerate import main

    base = ["--verifier", "v", "--source", "s", "--out", "o.jsonl"]
    for extra, message in ((["--rows-per-shard", "4"], "go with --capture DIR"),
                           (["--capture", "c"], "--capture needs --backend vllm"),
                           (["--capture", "c", "--backend", "vllm"], "--capture needs --config"),
                           (["--data.seq_len=8"], "unrecognized arguments: --data.seq_len=8")):
        with pytest.raises(SystemExit) as stop:
            main([*base, *extra])
        assert stop.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
