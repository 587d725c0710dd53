from dataclasses import dataclass, field
from pathlib import Path

import pytest
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
    from draftheads.train.eagle import EagleRunConfig
    from draftheads.train.medusa import MedusaRunConfig

    cls = MedusaRunConfig if "medusa" in path.stem else EagleRunConfig
    cfg = parse_config(cls, ["--config", str(path)])
    if path.stem == "peagle-tiny":
        assert cfg.eagle.parallel and cfg.eagle.version == 3
