"""train/mtp.py end to end on a tiny GLM-4.5-shaped checkpoint that ships an MTP layer: the run folder, the export
(the checkpoint with its MTP layer replaced under the same names, everything else unchanged), the train/serve
check, `draftheads eval --method mtp` on the export, and the one-line refusals of a checkpoint without MTP weights
and of a family we do not fine-tune."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftheads.models.layouts.mtp_checkpoint import read_mtp_layer
from draftheads.train.cli import main_guard
from draftheads.train.config import parse_config
from draftheads.train.mtp import MtpRunConfig, main
from tests.utils import reset_accelerate, save_tiny_mtp_checkpoint, save_tiny_verifier_with_tokenizer

pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def rows(folder: Path) -> Path:
    lines = [{"text": f"def f{i}(x):\n    return x * {i} + {i * i}  # number {i}\n" * 3} for i in range(14)]
    path = folder / "rows.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def tiny_args(verifier, source, output_dir, *extra):
    return [f"--verifier={verifier}", f"--data.source={source}", f"--output_dir={output_dir}", "--data.seq_len=32",
            "--data.max_rows=null", "--data.eval_rows=2", "--train.batch_size=2", "--train.max_steps=4",
            "--train.save_every=2", "--train.eval_every=2", "--train.eval_batches=2", "--train.log_every=1",
            "--train.warmup_steps=1", "--train.lr=1e-2", "--wandb.enabled=false", "--consistency.num_prompts=2",
            "--consistency.max_new_tokens=12", *extra]


@pytest.mark.parametrize("targets", ["verifier", "data"])
def test_a_run_fine_tunes_the_mtp_layer_and_writes_the_checkpoint_back(tmp_path, capsys, targets):
    verifier = save_tiny_mtp_checkpoint(tmp_path / "glm", tokenizer=True)
    reset_accelerate()
    summary = main(parse_config(MtpRunConfig, tiny_args(verifier, rows(tmp_path), tmp_path / "run",
                                                        f"--mtp.targets={targets}")))
    out = tmp_path / "run" / "drafter"
    assert summary["consistency"]["tau"] == summary["consistency"]["tau_in_memory"]
    assert (tmp_path / "run" / "step-000004").is_dir() and (tmp_path / "run" / "config.yaml").is_file()
    written, source = load_file(out / "model.safetensors"), load_file(verifier / "model.safetensors")
    assert set(written) == set(source)
    changed = {k for k in source if not torch.equal(written[k], source[k])}
    assert changed and all(k.startswith("model.layers.2.") for k in changed)  # only the MTP layer trained
    assert "model.layers.2.shared_head.head.weight" not in changed  # the shared head stays the verifier's
    for name in ("config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (verifier / name).read_bytes()
    meta = json.loads((out / "draftheads_mtp.json").read_text())["draftheads"]
    assert meta["method"] == "mtp" and meta["vllm_method"] == "glm4_moe_mtp" and meta["training"]["steps"] == 4
    assert read_mtp_layer(out).layer_index == 2
    # the export is a verifier whose own MTP layer our engine drafts with: `draftheads eval --method mtp`
    from draftheads.eval.__main__ import main as eval_main
    from draftheads.eval.measure.report import read_results

    assert eval_main(["--verifier", str(out), "--method", "mtp", "--prompts", "humaneval", "--num-prompts", "2",
                      "--max-new-tokens", "8", "--threads", "1", "--out", str(tmp_path / "eval")]) == 0
    assert "| mtp |" in capsys.readouterr().out
    results = read_results(tmp_path / "eval")
    assert results["summary"]["mtp"]["lossless"]
    for sample in results["samples"]:
        assert sample["runs"]["mtp"]["output_ids"] == sample["runs"]["autoregressive"]["output_ids"]


@pytest.mark.parametrize("case", ["no-mtp-weights", "llama"])
def test_a_checkpoint_we_cannot_fine_tune_is_one_line(tmp_path, capsys, case):
    if case == "llama":
        verifier = save_tiny_verifier_with_tokenizer(tmp_path / "llama", "llama")
        want = f"config error: {verifier / 'config.json'}: model_type 'llama' has no MTP layer draftheads fine-tunes"
    else:
        verifier = save_tiny_mtp_checkpoint(tmp_path / "glm", tokenizer=True, mtp=False)
        want = (f"config error: {verifier}: no MTP weights in its safetensors (config.json says "
                "num_nextn_predict_layers=1)")
    source = rows(tmp_path)
    reset_accelerate()
    capsys.readouterr()  # what building the checkpoint printed
    with pytest.raises(SystemExit) as exit_:
        main_guard(main, MtpRunConfig, tiny_args(verifier, source, tmp_path / "run"))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith(want), err
