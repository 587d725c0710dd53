"""`draftheads eval` end to end on a tiny random verifier with a small BPE tokenizer: the files it writes, a sane
summary, outputs that re-check against plain greedy decoding, HF baselines on the same prompts; command-line
errors; wandb offline."""

import json

import pytest
import torch

from draftheads.eval.__main__ import UsageError, main, method_specs
from draftheads.eval.measure.report import read_results
from draftheads.eval.measure.recheck import recheck
from tests.eval_fixtures import build_eval_setup
from tests.utils import peaked_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return build_eval_setup(tmp_path_factory.mktemp("evalcli"))


def test_cli_end_to_end(tiny_run, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--verifier", str(tiny_run / "verifier"), "--method", "draft-model", "--draft", str(tiny_run / "draft"),
            "--method", "eagle", "--draft", str(tiny_run / "eagle3"), "--option", "num_draft_tokens=3",
            "--option", "eagle.depth=3", "--option", "eagle.top_k=2", "--option", "eagle.total_tokens=5",
            "--prompts", "humaneval", "--num-prompts", "3", "--max-new-tokens", "16", "--batch-size", "2",
            "--compare", "hf,hf-assisted", "--threads", "1", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| method | tau |" in printed and "| draft-model |" in printed

    for name in ("results.json", "report.md", "accepted_length.png", "per_position_acceptance.png",
                 "tokens_per_s.png"):
        assert (out / name).stat().st_size > 0, name
    results = read_results(out)
    summary = results["summary"]
    assert list(summary) == ["autoregressive", "draft-model", "eagle", "hf", "hf-assisted"]
    for label, row in summary.items():
        assert row["tau"] >= 1.0 and row["speedup"] > 0 and row["tokens_per_s"] > 0 and row["lossless"], label
        positions = row["per_position_acceptance"]
        if positions is not None:
            assert all(0 <= p <= 1 for p in positions), label
            assert all(a >= b for a, b in zip(positions, positions[1:])), label
    assert summary["autoregressive"]["speedup"] == 1.0 and summary["autoregressive"]["tau"] == 1.0
    assert summary["draft-model"]["tau"] > 1.2  # a noisy copy of the verifier is right often
    assert len(summary["draft-model"]["per_position_acceptance"]) == 3
    assert summary["draft-model"]["efficiency"] == pytest.approx(summary["draft-model"]["speedup"]
                                                                 / summary["draft-model"]["tau"])
    assert summary["hf-assisted"]["drafter"]["assistant"] == "draft model"

    samples = results["samples"]
    assert len(samples) == 3 and samples[0]["id"] == "HumanEval/0"
    for s in samples:
        assert s["method"] == "draft-model" and s["output_ids"] == s["runs"]["draft-model"]["output_ids"]
        assert len(s["prompt_ids"]) > 50 and 1 <= len(s["output_ids"]) <= 16
        assert sum(a + 1 for a in s["accepted"]) >= len(s["output_ids"])
        outputs = {label: run["output_ids"] for label, run in s["runs"].items()}
        assert all(o == outputs["autoregressive"] for o in outputs.values()), s["id"]  # greedy: one answer
    cfg, env = results["config"], results["environment"]
    assert cfg["command"].startswith("draftheads eval --verifier ") and cfg["settings"]["max_new_tokens"] == 16
    assert cfg["methods"][2]["options"] == {"depth": 3, "top_k": 2, "total_tokens": 5}
    assert cfg["methods"][1]["options"] == {"num_draft_tokens": 3}
    assert env["torch_threads"] == 1 and env["device"] == "cpu" and env["torch"] == torch.__version__
    assert "| eagle |" in (out / "report.md").read_text()

    checked, mismatches, ties = recheck(results)
    assert checked == 15 and not mismatches and not ties


def test_verify_catches_a_changed_output(tiny_run, tmp_path, capsys):
    from draftheads.eval.measure.recheck import main as verify_main

    out = tmp_path / "out"
    assert main(["--verifier", str(tiny_run / "verifier"), "--method", "ngram", "--prompts", "humaneval",
                 "--num-prompts", "2", "--max-new-tokens", "8", "--out", str(out)]) == 0
    assert verify_main([str(out / "results.json")]) == 0
    results = json.loads((out / "results.json").read_text())
    results["samples"][1]["runs"]["ngram"]["output_ids"][3] += 1
    (out / "results.json").write_text(json.dumps(results))
    capsys.readouterr()
    assert verify_main([str(out / "results.json")]) == 1
    assert "ngram / HumanEval/1: differs at new token 3" in capsys.readouterr().out


def test_a_near_tie_of_the_verifier_is_not_a_mismatch():
    """Where the verifier's two best logits are equal to float rounding, either token is its greedy choice."""
    from types import SimpleNamespace

    from draftheads.eval.measure.recheck import tie_gap

    class FixedLogits(torch.nn.Module):
        def __init__(self, row):
            super().__init__()
            self.row = torch.nn.Parameter(torch.tensor(row))

        def forward(self, ids):
            return SimpleNamespace(logits=self.row.expand(ids.shape[0], ids.shape[1], -1))

    tied = FixedLogits([4.6936674, 4.6936669, 3.8, 0.0])  # a gap of 5e-7, as float32 rounding leaves
    assert tie_gap(tied, [1, 2], got=1, expected=0) == pytest.approx(5e-7, rel=0.2)
    apart = FixedLogits([4.70, 4.69, 3.8, 0.0])
    assert tie_gap(apart, [1, 2], got=1, expected=0) is None
    assert tie_gap(tied, [1, 2], got=2, expected=0) is None
    assert tie_gap(FixedLogits([4.70, 4.69, 0.0]).to(torch.bfloat16), [1], got=1, expected=0) is not None


def test_sampled_run(tiny_run, tmp_path):
    out = tmp_path / "out"
    assert main(["--verifier", str(tiny_run / "verifier"), "--method", "draft-model", "--draft",
                 str(tiny_run / "draft"), "--prompts", "humaneval", "--num-prompts", "2", "--max-new-tokens", "8",
                 "--temperature", "1.0", "--top-p", "0.9", "--seed", "3", "--compare", "hf", "--out", str(out)]) == 0
    results = read_results(out)
    assert results["summary"]["draft-model"]["tau"] >= 1.0
    assert recheck(results) == (0, [], [])  # sampled runs are not re-checked token by token


def test_command_line_errors(tiny_run, tmp_path, capsys):
    with pytest.raises(UsageError, match="needs a --draft"):
        method_specs(["eagle"], [], [], "", False)
    with pytest.raises(UsageError, match="more drafts than methods"):
        method_specs(["ngram"], ["x"], [], "", False)
    with pytest.raises(UsageError, match="unknown method 'hf'.*--compare"):
        method_specs(["hf"], [], [], "", False)
    with pytest.raises(UsageError, match="has no option 'depth'"):
        method_specs(["ngram"], [], ["depth=3"], "", False)
    with pytest.raises(UsageError, match="no method labelled 'medusa'"):
        method_specs(["ngram"], [], ["medusa.chain=2"], "", False)
    with pytest.raises(UsageError, match="appear twice"):
        method_specs(["ngram", "ngram"], [], [], "", False)
    specs = method_specs(["a=eagle", "b=eagle"], ["x", "y"], ["a.chain=3", "depth=5"], "hf", False)
    assert [(s.label, s.method, s.draft, s.options) for s in specs] == [
        ("autoregressive", "autoregressive", None, {}), ("a", "eagle", "x", {"chain": 3, "depth": 5}),
        ("b", "eagle", "y", {"depth": 5}), ("hf", "hf", None, {})]
    # A draft model whose tokenizer is not the verifier's is refused before anything runs.
    other = tmp_path / "other"
    peaked_model("llama", vocab_size=512).save_pretrained(other)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(other)
    assert main(["--verifier", str(tiny_run / "verifier"), "--method", "draft-model", "--draft", str(other),
                 "--prompts", "humaneval", "--num-prompts", "1", "--out", str(tmp_path / "o")]) == 2
    assert "tokenizer differs from the verifier's" in capsys.readouterr().err


def test_wandb_offline(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "out"
    assert main(["--verifier", str(tiny_run / "verifier"), "--method", "ngram", "--prompts", "humaneval",
                 "--num-prompts", "1", "--max-new-tokens", "8", "--out", str(out), "--wandb"]) == 0
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    media = list(runs[0].rglob("*.png"))
    assert len(media) == 3, media
