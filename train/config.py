"""Run configs: typed dataclasses, loaded from YAML, overridden on the command line.

    accelerate launch train/medusa.py --config configs/medusa-tiny.yaml --train.max_steps=200 --medusa.num_heads=3

Parsing is jsonargparse's: unknown keys and wrong types are errors that name the key; every field's docstring is
its `--help` text. Each trainer defines its own root dataclass (a `RunConfig` plus its method section) and calls
`parse_config`. The resolved config is written to `{output_dir}/config.yaml` and sent to wandb.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import yaml

from draftheads.data.config import DataConfig
from draftheads.models.atomic import write_text


FLOAT32_MAX = 3.4028234663852886e38
#: Characters wandb refuses in a project name.
WANDB_PROJECT_FORBIDS = "/\\#?%:"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and what was expected."""


@dataclass
class TrainConfig:
    """The optimisation loop, checkpoints and resume."""

    max_steps: int = 1000
    """Optimizer steps to run (each step sees batch_size x grad_accum x processes sequences)."""
    batch_size: int = 8
    """Sequences per process per micro-batch."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (through `accelerator.accumulate`)."""
    lr: float = 1e-3
    """Peak learning rate of the drafter (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """`adamw` for every parameter; `muon`: Muon for the drafter's hidden matrices, AdamW for its heads, norms and
    vectors, one lr for both (train/optim.py; not with Medusa-2's parameter groups, nor FSDP-sharded drafters)."""
    optimizer_state: Literal["float32", "bfloat16"] = "float32"
    """dtype of AdamW's two moments: `bfloat16` keeps 4 bytes of state per trained weight instead of 8, updated in
    fp32 and written back with stochastic rounding (models/adamw.py); with train.optimizer=adamw only."""
    warmup_steps: int = 20
    """Linear warm-up steps before the cosine decay."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr x min_lr_ratio."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"
    """Autocast precision for the drafter's forward (fp16 needs a GPU)."""
    save_every: int = 200
    """Write a resumable `step-NNNNNN/` checkpoint every this many steps (0: only at the end)."""
    keep_last: int = 2
    """Keep the newest this many step checkpoints."""
    resume: str = "auto"
    """`auto` (continue from the newest complete checkpoint in output_dir, if any), `none`, or a checkpoint path."""
    seed: int = 0
    """Seed for weights, data order and noise, in [0, 2**32)."""
    log_every: int = 10
    """Log train metrics every this many steps (metrics stay on device in between)."""
    eval_every: int = 0
    """Held-out evaluation every this many steps (0: only at the end)."""
    eval_batches: int = 8
    """Held-out micro-batches per evaluation."""
    max_bad_steps: int = 10
    """Stop after this many consecutive steps with a non-finite loss (each is skipped and counted)."""
    num_workers: int = 0
    """DataLoader worker processes."""

    def __post_init__(self):
        for key in ("max_steps", "batch_size", "grad_accum", "keep_last", "log_every", "max_bad_steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)}: expected a positive integer")
        for key in ("save_every", "eval_every", "warmup_steps", "eval_batches", "num_workers"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key}={getattr(self, key)}: expected >= 0")
        if not (math.isfinite(self.lr) and 0 < self.lr <= FLOAT32_MAX):
            raise ConfigError(f"train.lr={self.lr}: expected a finite number > 0 (at most {FLOAT32_MAX:.3g}, the "
                              "largest float32, which the optimizer computes in)")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(math.isfinite(b) and 0 <= b < 1 for b in betas):
            raise ConfigError(f"train.betas={list(betas)}: expected two AdamW betas, each in [0, 1) (e.g. [0.9, 0.95])")
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ConfigError(f"train.grad_clip={self.grad_clip}: expected a finite norm >= 0 (0 turns clipping off)")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"train.weight_decay={self.weight_decay}: expected a finite value >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio}: expected a value in [0, 1]")
        if not 0 <= self.seed < 2 ** 32:  # numpy's seed range (accelerate's set_seed seeds numpy too)
            raise ConfigError(f"train.seed={self.seed}: expected an integer in [0, 2**32)")
        if self.optimizer_state != "float32" and self.optimizer != "adamw":
            raise ConfigError(f"train.optimizer_state={self.optimizer_state} with train.optimizer={self.optimizer}: "
                              "low-precision state is AdamW's; use train.optimizer=adamw or optimizer_state=float32")
        if not self.resume.strip():
            raise ConfigError(f"train.resume={self.resume!r}: expected auto, none or a checkpoint folder")
        if self.warmup_steps >= self.max_steps:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} >= train.max_steps={self.max_steps}: the run "
                              "would end before its warm-up does; lower train.warmup_steps (e.g. to a tenth of the run)")


@dataclass
class WandbConfig:
    """Weights & Biases logging (offline automatically when no API key is present)."""

    enabled: bool = True
    """Log to wandb at all."""
    project: str | None = None
    """Project name (1 to 128 characters, none of `/ \\ # ? % :`); default $WANDB_PROJECT, else `draftheads`."""
    entity: str | None = None
    """Team or user; default $WANDB_ENTITY or your default entity."""
    run_name: str | None = None
    """Run name; default the output folder's name."""
    mode: Literal["auto", "online", "offline"] = "auto"
    """`auto`: online when an API key is configured, else offline."""

    def __post_init__(self):
        # wandb's own rule, checked when it starts (after the verifier and the data have loaded)
        bad = sorted(set(WANDB_PROJECT_FORBIDS) & set(self.project or ""))
        if self.project is not None and (bad or not 0 < len(self.project.strip()) <= 128):
            why = f"it holds {' '.join(bad)}" if bad else f"{len(self.project)} characters"
            raise ConfigError(f"wandb.project={self.project!r}: {why}; expected 1 to 128 characters, none of "
                              f"{' '.join(WANDB_PROJECT_FORBIDS)} (null: $WANDB_PROJECT, else draftheads)")


@dataclass
class ConsistencyConfig:
    """The end-of-run train/serve check: the exported drafter, reloaded from disk, decodes held-out prompts through
    our engine (eval/measure/consistency.py) and must accept exactly what the in-memory drafter accepts."""

    enabled: bool = True
    """Run the check after the export; its tau is logged as eval/tau (and eval/tau_in_memory)."""
    num_prompts: int = 4
    """Held-out prompts: the first rows of the run's held-out data (stdlib: the `eval` split's files)."""
    prompt_tokens: int = 64
    """Tokens of each held-out row used as the prompt."""
    max_new_tokens: int = 32
    """Tokens generated greedily per prompt, by each of the two drafters."""
    tolerance: float = 0.0
    """Largest allowed |tau(export) - tau(in memory)|; 0 also requires every verifier call to accept the same."""

    def __post_init__(self):
        for key in ("num_prompts", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"consistency.{key}={getattr(self, key)}: expected a positive integer")
        if self.prompt_tokens < 2:
            raise ConfigError(f"consistency.prompt_tokens={self.prompt_tokens}: expected at least 2")
        if self.tolerance < 0:
            raise ConfigError(f"consistency.tolerance={self.tolerance}: expected >= 0")


@dataclass
class RunConfig:
    """What every training run has; each trainer adds its method's section."""

    verifier: str = "tiny-code"
    """The frozen verifier: a hub id, a local model folder, or an embedded name (`tiny-code`, `tiny-micro`)."""
    output_dir: str = "runs/default"
    """Run folder: config.yaml, step-NNNNNN/ checkpoints, logs, and the exported drafter in drafter/."""
    verifier_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the verifier is loaded in."""
    trust_remote_code: bool = False
    """Allow model code from the verifier's repository (off: only transformers' own architectures)."""
    features: Literal["online", "offline"] = "online"
    """`online`: run the frozen verifier inside each step; `offline`: read the hidden-state cache."""
    feature_cache: str | None = None
    """Folder of the offline hidden-state cache (with features: offline)."""
    verifier_embedding: Literal["auto", "device", "host"] = "auto"
    """Where an offline run keeps the verifier's token embedding (a step reads only its tokens' rows): `host`
    memory, `device` memory, or `auto`: host when training on an accelerator, so a GPU holds lm_head and the final
    norm alone. An embedding tied to lm_head stays with the head. Online runs keep it with the verifier's layers."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The optimisation loop."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and held-out data."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Experiment tracking."""
    consistency: ConsistencyConfig = field(default_factory=ConsistencyConfig)
    """End-of-run check that the exported drafter, reloaded, decodes like the trained one."""

    @property
    def drafter_dir(self) -> Path:
        """Where the exported drafter lands."""
        return Path(self.output_dir) / "drafter"

    def __post_init__(self):
        check_finite(self)
        for key in ("output_dir", "feature_cache"):
            value = getattr(self, key)
            if value is not None and not value.strip():  # Path("") is the working folder
                raise ConfigError(f"{key}={value!r}: expected a folder path")
        if self.features == "offline" and not self.feature_cache:
            raise ConfigError("features=offline needs feature_cache: the folder written by `draftheads dump-features`")
        if self.verifier_embedding == "host" and self.features != "offline":
            raise ConfigError("verifier_embedding=host needs features=offline: an online run runs the verifier's "
                              "layers, which read the embedding on the device (set verifier_embedding=auto or device)")



@dataclass
class ExportedRunConfig(RunConfig):
    """A run whose drafter can be exported in more than one engine layout (EAGLE, DFlash)."""

    engine: Literal["vllm", "sglang", "speculators"] = "vllm"
    """Layout of the exported drafter (models/layouts/): vLLM's (SGLang reads EAGLE-3 and DFlash in it too), SGLang's
    own EAGLE layout (midlayer.*), or the speculators library's (served by `vllm serve DRAFTER_DIR` with no flags).
    Settings the engine would read differently from how the drafter trains are refused when the config is read."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the exported weights (training keeps fp32 master weights either way)."""

def check_finite(cfg, prefix: str = "") -> None:
    """Every float setting of a config (nested sections, lists and tuples included) must be a finite number: YAML's
    `.nan` / `.inf` or `1e999` are refused naming the key, whatever the field's own range check would let through."""
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_finite(value, f"{key}.")
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{key}={value}: expected a finite number")


C = TypeVar("C")


def _build_parser(cls: type, prog: str | None):
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(prog=prog, exit_on_error=False, description=(cls.__doc__ or "").strip())
    parser.add_argument("--config", action=ActionConfigFile, help="YAML run config (see configs/).")
    parser.add_class_arguments(cls, nested_key=None)
    return parser


def parse_config(cls: type[C], argv: list[str] | None = None, prog: str | None = None) -> C:
    """`--config FILE.yaml` then `--section.key=value` overrides, into a `cls` instance (checks run)."""
    from jsonargparse import ArgumentError

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _build_parser(cls, prog)
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        raise SystemExit(0)
    try:
        namespace = parser.parse_args(argv)
        built = parser.instantiate(namespace)
    except (ArgumentError, ValueError, TypeError) as err:
        raise ConfigError(_tidy(str(err))) from None
    values = {f.name: getattr(built, f.name) for f in dataclasses.fields(cls) if f.init}
    try:
        return cls(**values)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None


def _tidy(message: str) -> str:
    # jsonargparse joins nested reasons with newlines and indentation; one line reads better in a log.
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return " ".join(lines)


def config_dict(cfg) -> dict:
    """A plain dict of a config (tuples as lists) for YAML, JSON and wandb."""

    def plain(value):
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return plain(dataclasses.asdict(cfg))


def save_config(cfg, folder: str | os.PathLike) -> Path:
    """Write the resolved config to `folder/config.yaml` (atomically), so a run folder says how it was made."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return write_text(folder / "config.yaml", yaml.safe_dump(config_dict(cfg), sort_keys=False))
