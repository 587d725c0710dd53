from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml

from draftheads.train.config import ConfigError, RunConfig, parse_config, save_config


@dataclass
class ToyMethod:
    """A method section."""

    num_heads: int = 4
    """Heads."""


@dataclass
class ToyRun(RunConfig):
    """A run with a method section."""

    toy: ToyMethod = field(default_factory=ToyMethod)
    """The method."""


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_then_cli_overrides(tmp_path):
    path = write(tmp_path, "verifier: tiny-micro\noutput_dir: runs/x\ntrain:\n  max_steps: 5\n  warmup_steps: 1\n"
                           "toy:\n  num_heads: 2\n")
    cfg = parse_config(ToyRun, ["--config", path, "--train.max_steps=7", "--toy.num_heads=3"])
    assert isinstance(cfg, ToyRun)
    assert (cfg.verifier, cfg.train.max_steps, cfg.toy.num_heads) == ("tiny-micro", 7, 3)
    assert cfg.train.seed == 0 and cfg.data.source == "stdlib"
    assert str(cfg.drafter_dir) == "runs/x/drafter"


def test_unknown_key_in_yaml_names_it(tmp_path):
    path = write(tmp_path, "train:\n  max_stpes: 5\n")
    with pytest.raises(ConfigError, match="max_stpes"):
        parse_config(ToyRun, ["--config", path])


def test_unknown_key_on_cli_names_it():
    with pytest.raises(ConfigError, match="--toy.bogus"):
        parse_config(ToyRun, ["--toy.bogus=1"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="train.max_steps"):
        parse_config(ToyRun, ["--train.max_steps=lots"])


def test_invariants_are_checked():
    with pytest.raises(ConfigError, match=r"train.max_steps=0"):
        parse_config(ToyRun, ["--train.max_steps=0"])
    with pytest.raises(ConfigError, match="feature_cache"):
        parse_config(ToyRun, ["--features=offline"])
    with pytest.raises(ConfigError, match=r"verifier_embedding=host needs features=offline"):
        parse_config(ToyRun, ["--verifier_embedding=host"])


def test_where_an_offline_run_keeps_the_verifier_embedding():
    from draftheads.train.placement import embedding_device

    offline = ["--features=offline", "--feature_cache=cache"]
    for choice, cpu, cuda in [("auto", None, "cpu"), ("host", "cpu", "cpu"), ("device", None, None)]:
        cfg = parse_config(ToyRun, [*offline, f"--verifier_embedding={choice}"])
        assert (embedding_device(cfg, "cpu"), embedding_device(cfg, torch.device("cuda", 0))) == (cpu, cuda), choice


@pytest.mark.parametrize("flag, message", [
    ("--train.lr=1e999", r"train\.lr=inf: expected a finite number > 0"),
    ("--train.lr=1e39", r"train\.lr=1e\+39: .*at most 3\.4e\+38"),
    ("--train.lr=0", r"train\.lr=0\.0"),
    ("--train.betas=[1.5,0.9]", r"train\.betas=\[1\.5, 0\.9\]: expected two AdamW betas, each in \[0, 1\)"),
    ("--train.betas=[0.9,1.0]", r"train\.betas=\[0\.9, 1\.0\]"),
    ("--train.grad_clip=-1", r"train\.grad_clip=-1\.0: expected a finite norm >= 0"),
    ("--train.grad_clip=1e999", r"train\.grad_clip=inf"),
    ("--train.weight_decay=-0.1", r"train\.weight_decay=-0\.1"),
    ("--consistency.tolerance=1e999", r"consistency\.tolerance=inf: expected a finite number"),
], ids=lambda x: x if x.startswith("--") else "")
def test_numbers_are_range_checked_before_anything_loads(flag, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(ToyRun, [flag])


def test_a_nan_in_the_yaml_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.lr=nan: expected a finite number"):
        parse_config(ToyRun, ["--config", write(tmp_path, "train:\n  lr: .nan\n")])
    with pytest.raises(ConfigError, match=r"train\.min_lr_ratio=nan"):
        parse_config(ToyRun, ["--config", write(tmp_path, "train:\n  min_lr_ratio: .nan\n")])


def test_steps_and_heads_must_fit_the_sequence():
    from draftheads.train.eagle import EagleRunConfig
    from draftheads.train.medusa import MedusaRunConfig

    assert parse_config(EagleRunConfig, ["--data.seq_len=32", "--eagle.ttt_steps=30"]).eagle.ttt_steps == 30
    with pytest.raises(ConfigError, match=r"eagle\.ttt_steps=31 with data\.seq_len=32: .*<= 30"):
        parse_config(EagleRunConfig, ["--data.seq_len=32", "--eagle.ttt_steps=31"])
    with pytest.raises(ConfigError, match=r"eagle\.ttt_steps=31 with data\.seq_len=32"):  # EAGLE-1's scored chains
        parse_config(EagleRunConfig, ["--data.seq_len=32", "--eagle.version=1", "--eagle.ttt_steps=31"])
    assert parse_config(MedusaRunConfig, ["--data.seq_len=32", "--medusa.num_heads=30"]).medusa.num_heads == 30
    with pytest.raises(ConfigError, match=r"medusa\.num_heads=31 with data\.seq_len=32"):
        parse_config(MedusaRunConfig, ["--data.seq_len=32", "--medusa.num_heads=31"])


def test_the_draft_vocabulary_holds_the_draft_trees_top_k():
    from draftheads.eval.drafters.eagle import TREE_TOP_K
    from draftheads.train.eagle import EagleRunConfig

    assert parse_config(EagleRunConfig, [f"--eagle.draft_vocab_size={TREE_TOP_K}"]).eagle.draft_vocab_size == 4
    with pytest.raises(ConfigError, match=r"eagle\.draft_vocab_size=3: .*top 4 draft tokens"):
        parse_config(EagleRunConfig, ["--eagle.draft_vocab_size=3"])
    # parallel drafting drafts a chain (one token per step): any size does
    assert parse_config(EagleRunConfig, ["--eagle.draft_vocab_size=1", "--eagle.parallel=true"]).eagle.parallel


def test_resolved_config_is_saved(tmp_path):
    cfg = parse_config(ToyRun, ["--train.resume=none", "--toy.num_heads=2"])
    saved = yaml.safe_load(save_config(cfg, tmp_path).read_text())
    assert saved["train"]["resume"] == "none" and saved["toy"]["num_heads"] == 2
    again = parse_config(ToyRun, ["--config", str(tmp_path / "config.yaml")])
    assert again == cfg


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_every_run_config_parses_with_its_trainer(path):
    """configs/*.yaml are read by the trainer their name says (validation included, no model loaded)."""
    from draftheads.train.dflash import DFlashRunConfig
    from draftheads.train.eagle import EagleRunConfig
    from draftheads.train.medusa import MedusaRunConfig
    from draftheads.train.mtp import MtpRunConfig

    cls = MedusaRunConfig if "medusa" in path.stem else DFlashRunConfig if "dflash" in path.stem else \
        MtpRunConfig if path.stem.endswith("-mtp") else EagleRunConfig
    cfg = parse_config(cls, ["--config", str(path)])
    if path.stem == "peagle-tiny":
        assert cfg.eagle.parallel and cfg.eagle.version == 3
