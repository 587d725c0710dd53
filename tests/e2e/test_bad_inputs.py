"""The bad-input catalogue: every bad input a user can give the trainers ends in one clear error naming what to fix.

Inputs already covered where their code lives are listed in REFERENCED (the test that covers each is checked to
exist, so the catalogue cannot silently go stale); the rest are tested here, through the real trainers where the
check lives in them. Also here: the numerical guard end to end (a verifier whose features are NaN makes every loss
non-finite: steps are skipped and counted, then the run stops with the last good checkpoint intact).
"""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftheads.models.export import DrafterFormatError
from draftheads.models.verifier import Verifier, VerifierError
from draftheads.train.checkpoint import complete_checkpoints
from draftheads.train.config import ConfigError, RunConfig, WandbConfig, parse_config
from draftheads.train.eagle import EagleRunConfig
from draftheads.train.eagle import main as eagle_main
from draftheads.train.loop import NonFiniteLossError
from draftheads.train.placement import load_verifier
from draftheads.train.tracking import build_accelerator
from tests.utils import save_tiny_verifier_with_tokenizer

ROOT = Path(__file__).resolve().parents[2]

REFERENCED = {
    "missing verifier folder": "test_verifier::test_missing_folder_is_a_clear_error",
    "verifier with pickle weights only": "test_verifier::test_pickle_only_verifier_is_refused",
    "drafter for another verifier (fingerprint, hidden size, layer count, vocab), EAGLE":
        "test_eagle_export::test_other_verifiers_are_refused",
    "drafter for another verifier, Medusa": "test_medusa_export::test_mismatched_verifier_is_refused_by_name",
    "drafter stored describe() differs (hidden size, fingerprint)": "test_verifier::test_drafter_mismatch_names_the_field",
    "EAGLE-3 layer ids out of range (verifier)": "test_verifier::test_default_eagle3_layers_and_range_check",
    "drafter folder with missing / misshapen weights": "test_eagle_export::test_corrupt_folders_name_the_problem",
    "Medusa drafter folder with missing / misshapen weights": "test_medusa_export::test_corrupt_or_foreign_folders_are_named",
    "malformed dataset rows (counted, skipped)": "test_data_sources::test_malformed_rows_skipped_counted_with_one_warning",
    "malformed dataset rows (strict: file and row named)": "test_data_sources::test_strict_names_file_row_and_expectation",
    "empty dataset after filtering": "test_data_sources::test_empty_dataset_after_filtering",
    "conversations without assistant turns, then empty": "test_data_batching::test_unusable_conversations_are_counted_then_empty_is_an_error",
    "row longer than data.seq_len (truncated with a count; strict: error)": "test_data_batching::test_padding_shapes_truncation_count_and_strict",
    "unknown config key (YAML)": "test_config::test_unknown_key_in_yaml_names_it",
    "unknown config key (command line)": "test_config::test_unknown_key_on_cli_names_it",
    "unknown config key (trainers)": "test_train_eagle::test_unknown_config_keys_are_named",
    "wrong type for a key": "test_config::test_wrong_type_names_the_key",
    "out-of-range values": "test_config::test_invariants_are_checked",
    "non-finite loss once (skipped, counted, logged)": "test_train_loop::test_nonfinite_loss_is_skipped_and_counted",
    "train.resume pointing at an incomplete folder": "test_train_loop::test_checkpoints_are_atomic_and_pruned",
}


@pytest.mark.parametrize("what", sorted(REFERENCED))
def test_referenced_test_exists(what):
    module, name = REFERENCED[what].split("::")
    tier = next((t for t in ("unit", "integration", "e2e") if (ROOT / "tests" / t / f"{module}.py").is_file()), None)
    assert tier is not None, f"{module}.py in no tier of tests/"
    assert callable(getattr(importlib.import_module(f"tests.{tier}.{module}"), name, None)), REFERENCED[what]


# ---- fixtures ------------------------------------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("fresh_accelerate")


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    return save_tiny_verifier_with_tokenizer(tmp_path_factory.mktemp("bad-inputs") / "v")


def eagle_args(verifier, out, *extra):
    return ["--config", str(ROOT / "configs/eagle3-tiny.yaml"), f"--verifier={verifier}", f"--output_dir={out}",
            "--wandb.enabled=false", "--data.seq_len=32", "--data.max_rows=3", "--data.eval_rows=1",
            "--train.batch_size=2", "--train.max_steps=4", "--train.save_every=2", "--train.eval_every=0",
            "--train.eval_batches=1", "--train.log_every=1", "--train.warmup_steps=1", "--train.mixed_precision=no",
            "--eagle.ttt_steps=2", "--eagle.draft_vocab_size=200", "--eagle.layer_ids=null", *extra]


def train_eagle(*args):
    return eagle_main(parse_config(EagleRunConfig, list(args)))


def copy_verifier(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- verifier and tokenizer ----------------------------------------------------------------------------------
def test_missing_verifier_folder_from_the_command_line_is_one_line(tmp_path):
    """The trainer CLI refuses a verifier path that is not there in one line (a config error: exit 2, before the run
    folder is made), not a traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTHEADS_QUIET": "1", "WANDB_MODE": "offline"}
    result = subprocess.run([sys.executable, str(ROOT / "train/eagle.py"), f"--verifier={tmp_path / 'nope'}",
                             f"--output_dir={tmp_path / 'run'}", "--wandb.enabled=false"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "does not exist" in result.stderr and str(tmp_path / "nope") in result.stderr
    assert not (tmp_path / "run").exists()
    assert "Traceback" not in result.stderr


def test_tokenizer_larger_than_the_verifier_vocab(tmp_path, verifier_dir):
    folder = copy_verifier(verifier_dir, tmp_path / "small-vocab")
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    small = 64
    tensors = {k: (v[:small].clone() if k in ("model.embed_tokens.weight", "lm_head.weight") else v)
               for k, v in tensors.items()}
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": small}))
    cfg = RunConfig(verifier=str(folder), output_dir=str(tmp_path / "run"), wandb=WandbConfig(enabled=False))
    with pytest.raises(VerifierError, match=r"tokenizer of .*small-vocab.* has \d+ tokens but the verifier's "
                                            r"vocab_size is 64"):
        load_verifier(cfg, "cpu")


def test_verifier_with_corrupt_safetensors(tmp_path, verifier_dir):
    folder = copy_verifier(verifier_dir, tmp_path / "cut")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a download cut in half
    with pytest.raises(VerifierError, match=r"cut': weights file model.safetensors is corrupt or incomplete.*download or copy it again"):
        Verifier.from_pretrained(folder)


def test_drafter_with_corrupt_safetensors(tmp_path, verifier_dir):
    from draftheads.models.eagle import EagleConfig, build_drafter
    from draftheads.models.export import export_eagle, load_eagle

    verifier = Verifier.from_pretrained(verifier_dir)
    folder = export_eagle(build_drafter(verifier, EagleConfig(version=1)), tmp_path / "drafter", verifier)
    (folder / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(DrafterFormatError, match="model.safetensors"):
        load_eagle(folder, verifier)


def test_sequence_longer_than_the_verifier_context(tmp_path, verifier_dir):
    cfg = RunConfig(verifier=str(verifier_dir), output_dir=str(tmp_path), wandb=WandbConfig(enabled=False))
    cfg.data.seq_len = 4096  # the tiny test verifiers have max_position_embeddings=512
    with pytest.raises(ConfigError, match=r"data.seq_len=4096 is longer than the verifier's context.*"
                                          r"max_position_embeddings=512"):
        load_verifier(cfg, "cpu")


def test_eagle3_layer_ids_out_of_range_in_a_run(tmp_path, verifier_dir):
    with pytest.raises(VerifierError, match=r"\[9\] out of range.*4 layers"):
        train_eagle(*eagle_args(verifier_dir, tmp_path, "--eagle.layer_ids=[1,2,9]"))
    assert not complete_checkpoints(tmp_path)


# ---- options this machine cannot honour ----------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is valid where a GPU is")
def test_fp16_on_cpu_is_refused(tmp_path):
    cfg = RunConfig(output_dir=str(tmp_path), wandb=WandbConfig(enabled=False))
    cfg.train.mixed_precision = "fp16"
    with pytest.raises(ConfigError, match="train.mixed_precision=fp16 needs a CUDA GPU"):
        build_accelerator(cfg)


def test_launch_config_grad_accum_must_match_the_run_config(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")  # what a DeepSpeed launch config sets
    cfg = RunConfig(output_dir=str(tmp_path), wandb=WandbConfig(enabled=False))
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=4 but train.grad_accum=1; make them equal"):
        build_accelerator(cfg)


# ---- the numerical guard, end to end -------------------------------------------------------------------------
def test_nonfinite_losses_stop_the_run_with_the_last_good_checkpoint_intact(tmp_path, verifier_dir, monkeypatch):
    from draftheads.train.loop import TrainLoop

    from draftheads.models.verifier import Verifier

    out = tmp_path / "run"
    args = eagle_args(verifier_dir, out, "--train.max_steps=12", "--train.max_bad_steps=3")
    # 4 good steps (checkpoints at 2 and 4), then the verifier's features turn NaN everywhere, in the same run (a
    # verifier replaced on disk would be another run's input: refused before anything loads).
    poisoned, features, save = {"on": False, "good": None}, Verifier.features, TrainLoop.save

    def nan_once_poisoned(self, *args, **kwargs):
        out = features(self, *args, **kwargs)
        if poisoned["on"]:
            out.final = torch.full_like(out.final, float("nan"))
            out.layers = [torch.full_like(layer, float("nan")) for layer in out.layers]
        return out

    def save_then_poison(loop):
        path = save(loop)
        if loop.state.step == 4:
            poisoned["on"], poisoned["good"] = True, (path / "model.safetensors").read_bytes()
        return path

    monkeypatch.setattr(Verifier, "features", nan_once_poisoned)
    monkeypatch.setattr(TrainLoop, "save", save_then_poison)
    with pytest.raises(NonFiniteLossError, match=r"3 consecutive steps had a non-finite loss \(train.max_bad_steps=3"
                                                 r"\); stopping. Last good checkpoint: .*step-000004"):
        train_eagle(*args)

    assert [p.name for p in complete_checkpoints(out)] == ["step-000002", "step-000004"]
    assert (out / "step-000004" / "model.safetensors").read_bytes() == poisoned["good"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    counts = [(r["step"], r["train/bad_steps"]) for r in logged if "train/bad_steps" in r]
    assert counts[-2:] == [(5, 1), (6, 2)]  # each skipped step is counted in the log; the third one stops the run
