"""The peer bench's bookkeeping (scripts/bench_peers.py): --reuse keeps a result only while nothing it depends on
changed, and --docs replaces its verifier's section in place."""

from argparse import Namespace

import pytest

from tests.utils import script_module


@pytest.fixture(scope="module")
def bench():
    return script_module("bench_peers")


def test_reuse_only_when_command_documents_and_verifier_are_the_same(bench, tmp_path):
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    (out / "docs.jsonl").write_text('{"text": "a"}\n')
    folder = out / "drafter"
    folder.mkdir()
    args = Namespace(verifier_path=str(verifier), reuse=True)
    key = bench.run_key(args, out, ["train", "--seed=0"])
    bench.record(out, "ours", key, {"folder": str(folder), "tau": 2.0})
    assert bench.reused(args, out, "ours", key)["tau"] == 2.0
    assert bench.reused(Namespace(verifier_path=str(verifier), reuse=False), out, "ours", key) is None
    assert bench.run_key(args, out, ["train", "--seed=1"]) != key  # another command
    (out / "docs.jsonl").write_text('{"text": "b"}\n')
    assert bench.run_key(args, out, ["train", "--seed=0"]) != key  # other documents
    (out / "docs.jsonl").write_text('{"text": "a"}\n')
    (verifier / "config.json").write_text('{"x": 1}')
    assert bench.run_key(args, out, ["train", "--seed=0"]) != key  # another verifier
    (verifier / "config.json").write_text("{}")
    folder.rmdir()
    assert bench.reused(args, out, "ours", key) is None  # its folder is gone


def test_docs_section_is_replaced_in_place(bench, tmp_path):
    page = tmp_path / "peers.md"
    page.write_text("intro\n\n<!-- bench_peers a -->\nold\n<!-- bench_peers a -->\n\ntail\n")
    summary = {"verifier": "a", "rows": 8, "seq_len": 256, "tokens": 2000, "epochs": 1, "batch": 4, "seed": 0,
               "layer_ids": [1, 2, 3], "draft_vocab_size": 512, "prompts": 16, "max_new_tokens": 64, "k": 3,
               "optimizer": "adamw"}
    bench.write_docs(page, summary, "| table |")
    text = page.read_text()
    assert text.startswith("intro\n\n<!-- bench_peers a -->\n### a\n") and text.endswith("\n\ntail\n")
    assert "old" not in text and "| table |" in text and "1 epoch," in text
    bench.write_docs(page, {**summary, "verifier": "b"}, "| other |")
    assert page.read_text().count("<!-- bench_peers b -->") == 2 and "| table |" in page.read_text()


def test_optimizer_is_matched_for_ours_and_speculators(bench, tmp_path, capsys):
    def flags(optimizer):
        args = Namespace(verifier_path="v", batch=4, seq_len=256, rows=8, epochs=1, seed=0, optimizer=optimizer)
        return bench.speculators_flags(args, tmp_path, [1, 2, 3], 512, tmp_path / "s", tmp_path / "l")

    adamw, muon = flags("adamw"), flags("muon")
    assert adamw[adamw.index("--optimizer") + 1] == "adamw" and "--muon-weight-decay" not in adamw
    # Muon without weight decay on its matrices, as ours (speculators' own default decays them by 0.1)
    assert muon[muon.index("--optimizer") + 1] == "muon" and muon[muon.index("--muon-weight-decay") + 1] == "0.0"
    with pytest.raises(SystemExit):  # SpecForge has AdamW only: one line, before anything is built
        bench.main(["--out", str(tmp_path / "o"), "--optimizer", "muon"])
    assert "SpecForge 0.2.0 trains with AdamW only" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_muon_run_has_its_own_docs_section(bench, tmp_path):
    page = tmp_path / "peers.md"
    summary = {"verifier": "a", "rows": 8, "seq_len": 256, "tokens": 2000, "epochs": 1, "batch": 4, "seed": 0,
               "layer_ids": [1, 2, 3], "draft_vocab_size": 512, "prompts": 16, "max_new_tokens": 64, "k": 3,
               "optimizer": "adamw"}
    bench.write_docs(page, summary, "| adamw |")
    bench.write_docs(page, {**summary, "optimizer": "muon"}, "| muon |")
    text = page.read_text()
    assert "| adamw |" in text and "| muon |" in text and "### a, muon\n" in text
