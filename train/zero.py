"""DeepSpeed ZeRO through Accelerate: what `build_accelerator` (train/tracking.py) does around the run's Accelerator
when the launch config is DeepSpeed's (`distributed_type: DEEPSPEED`, configs/accelerate/deepspeed_zero*.yaml).

    handlers = before_accelerator()          # refuses a missing deepspeed; on a machine without GPUs: gloo
    accelerator = Accelerator(..., kwargs_handlers=handlers)
    settle_deepspeed(accelerator, cfg)       # refuses what DeepSpeed would not honour, fills its `auto` keys
    ...
    say(engine_line(model))                  # after accelerator.prepare: which engine really trains

Why each step:
- `accelerate launch` with a DeepSpeed config starts the processes with ACCELERATE_USE_DEEPSPEED=true. On a machine
  without a CUDA device Accelerate finds no distributed backend for the device, so DeepSpeed's own start-up makes a
  gloo group (its CPU accelerator, chosen when there is no GPU or with DS_ACCELERATOR=cpu, talks gloo unless oneCCL's
  bindings are installed) but Accelerate counts one process. Naming the backend (gloo) makes Accelerate count the
  group and keep DeepSpeed. (ACCELERATE_USE_CPU=true or `accelerate launch --cpu` instead drops DeepSpeed and trains
  DDP, silently: refused below.)
- DeepSpeed's CPU accelerator compiles a shared-memory all-reduce (C++ through torch's JIT builder: a compiler and
  about two minutes of two cores) when its communication starts; only DeepSpeed's inference all-reduce calls it, ZeRO
  training does not, so on the CPU it is marked unbuildable and a run starts in seconds.
- transformers partitions every model that `from_pretrained` loads while a ZeRO-3 config is registered with it
  (Accelerate registers one whatever `zero3_init_flag` says). The frozen verifier is read whole (its hidden states,
  lm_head rows and embedding), so the registration is dropped: DeepSpeed shards only what `accelerator.prepare` hands
  it, the drafter.
- DeepSpeed, not the loop, accumulates, clips and steps (`accelerator.backward` runs the engine's step at the
  accumulation boundary): its gradient_accumulation_steps and gradient_clipping must be the run's train.grad_accum and
  train.grad_clip (`auto` or absent: filled with them here, as are the batch sizes), its bf16/fp16 the run's
  train.mixed_precision; the run's own optimizer and schedule are used (a DeepSpeed `optimizer` / `scheduler`
  section is refused).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from draftheads.train.config import ConfigError, RunConfig

VERSION = "0.19.8"
"""The DeepSpeed release the e2e tier runs (pyproject.toml's `deepspeed` extra)."""


def requested() -> bool:
    """Whether the launch asks for DeepSpeed (what `accelerate launch` sets for a DeepSpeed config)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def before_accelerator() -> list:
    """Kwargs handlers for the run's Accelerator under a DeepSpeed launch ([] otherwise); refuses a missing
    deepspeed package."""
    if not requested():
        return []
    try:
        import deepspeed.ops
    except ImportError:
        raise ConfigError(f"{launch_config()} asks for DeepSpeed (distributed_type: DEEPSPEED, "
                          "ACCELERATE_USE_DEEPSPEED=true) but the deepspeed package is not installed: "
                          f"pip install 'draftheads[deepspeed]' (deepspeed=={VERSION}), or launch with "
                          "configs/accelerate/multi_gpu.yaml") from None
    if torch.cuda.is_available():
        return []
    from accelerate.utils import InitProcessGroupKwargs

    try:  # a private table, read once per process (deepspeed/ops/__init__.py keeps edits to it)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except (AttributeError, TypeError):
        pass  # another DeepSpeed: it compiles its kernel, slower to start, same training
    return [InitProcessGroupKwargs(backend="gloo")]


def settle_deepspeed(accelerator, cfg: RunConfig) -> None:
    """Refuse, in one line naming the key and the file, a DeepSpeed launch that would not train what the run config
    says, and fill the DeepSpeed config's `auto` gradient clipping with train.grad_clip. Under any other launch:
    nothing. Collective-free; every process decides the same."""
    from accelerate.utils import DistributedType

    if not requested():
        return
    source = launch_config()
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        why = ("ACCELERATE_USE_CPU=true (or `accelerate launch --cpu`) makes Accelerate drop DeepSpeed; unset it: a "
               "DeepSpeed launch config runs on the CPU as it is (configs/accelerate/deepspeed_zero2_cpu.yaml)"
               if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") else
               "launch with `accelerate launch --config_file` and the DeepSpeed config")
        raise ConfigError(f"{source} asks for DeepSpeed but Accelerate set up {accelerator.distributed_type} "
                          f"({accelerator.num_processes} process(es)), which would train without it; {why}")
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # the frozen verifier is loaded whole, never partitioned by from_pretrained
    plugin = accelerator.state.deepspeed_plugin
    config = plugin.deepspeed_config
    json_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    json_file = None if json_file == "none" else json_file

    def key(json_key: str, yaml_key: str | None = None) -> str:
        if json_file is not None or yaml_key is None:
            return f"{json_file or source}: {json_key}"
        return f"{source}: deepspeed_config.{yaml_key}"

    zero = config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise ConfigError(f"{key(section)}: draftheads trains with its own optimizer and schedule "
                              f"(train.optimizer, train.lr, train.warmup_steps); remove the {section} section")
    if cfg.train.optimizer == "muon":
        raise ConfigError(f"train.optimizer=muon under DeepSpeed ({source}): ZeRO hands the optimizer flat 1-D "
                          "partitions, not the matrices Muon orthogonalises; use train.optimizer=adamw or "
                          "configs/accelerate/multi_gpu.yaml")
    accum = config.get("gradient_accumulation_steps", "auto")
    if accum != "auto" and int(accum) != cfg.train.grad_accum:
        raise ConfigError(f"{key('gradient_accumulation_steps', 'gradient_accumulation_steps')}={accum} but "
                          f"train.grad_accum={cfg.train.grad_accum}: DeepSpeed would accumulate {accum} micro-batches "
                          "per step; make them equal, or leave the key out (the run config's is used)")
    clip = config.get("gradient_clipping", "auto")
    if clip == "auto":  # Accelerate would fill it with 1.0; absent, DeepSpeed would not clip at all
        config["gradient_clipping"] = float(cfg.train.grad_clip)
    elif float(clip) != float(cfg.train.grad_clip):
        raise ConfigError(f"{key('gradient_clipping', 'gradient_clipping')}={clip} but train.grad_clip="
                          f"{cfg.train.grad_clip}: DeepSpeed, not the loop, clips; make them equal, or leave the key "
                          "out (the run config's is used)")
    for dtype, name in (("bf16", "bf16"), ("fp16", "fp16")):
        enabled = str(config.get(dtype, {}).get("enabled", False)).lower() == "true"
        if enabled != (cfg.train.mixed_precision == name):
            raise ConfigError(f"{key(f'{dtype}.enabled')}={enabled} but train.mixed_precision="
                              f"{cfg.train.mixed_precision}; make them agree (or leave the {dtype} section out)")
    for what, json_key, yaml_key in (("optimizer", "zero_optimization.offload_optimizer.device",
                                      "offload_optimizer_device"),
                                     ("param", "zero_optimization.offload_param.device", "offload_param_device")):
        device = str(zero.get(f"offload_{what}", {}).get("device") or "none").lower()
        if device != "none" and not torch.cuda.is_available():
            raise ConfigError(f"{key(json_key, yaml_key)}={device} on a machine without a GPU: offloading moves "
                              "state out of GPU memory; set none (configs/accelerate/deepspeed_zero2_cpu.yaml)")
    for json_key, want, got in (("train_micro_batch_size_per_gpu", cfg.train.batch_size,
                                 config.get("train_micro_batch_size_per_gpu", "auto")),
                                ("train_batch_size", cfg.train.batch_size * cfg.train.grad_accum
                                 * accelerator.num_processes, config.get("train_batch_size", "auto"))):
        if got == "auto":  # Accelerate would take the smaller of the training and held-out loaders' batch sizes
            config[json_key] = want
        elif int(got) != want:
            raise ConfigError(f"{key(json_key)}={got} but the run trains {want} (train.batch_size x train.grad_accum "
                              "x processes); set it to auto")
    if stage == 3:
        if plugin.zero3_init_flag:
            raise ConfigError(f"{source}: deepspeed_config.zero3_init_flag=true: draftheads loads the frozen verifier "
                              "whole on every process and builds the drafter outside DeepSpeed; set it to false")
        if not zero.get("stage3_gather_16bit_weights_on_model_save", False):
            name = key("zero_optimization.stage3_gather_16bit_weights_on_model_save", "zero3_save_16bit_model")
            raise ConfigError(f"{name}=false: the export and the train/serve check gather the drafter's whole weights "
                              "(accelerator.get_state_dict), which ZeRO-3 then refuses; set it to true")


def engine_line(model) -> str | None:
    """One line naming the DeepSpeed engine that trains `model` (what `accelerator.prepare` returned): its ZeRO stage,
    optimizer and processes, and under ZeRO-3 the share of the weights this process holds. None when `model` is not
    a DeepSpeed engine."""
    if type(model).__name__ != "DeepSpeedEngine":
        return None
    stage = model.zero_optimization_stage()
    line = (f"[deepspeed] DeepSpeedEngine ZeRO-{stage}, {type(model.optimizer).__name__} over "
            f"{model.world_size} processes ({torch.distributed.get_backend()})")
    if stage == 3:
        held = sum(p.ds_tensor.numel() for p in model.module.parameters())
        total = sum(p.ds_numel for p in model.module.parameters())
        line += f"; this process holds {held} of {total} weights"
    return line


def launch_config() -> str:
    """The accelerate launch config file this process was started from, for messages: the parent's (`accelerate
    launch`, whose torchrun agent starts the processes) --config_file, else accelerate's default config."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        argv = []
    named = config_file_flag(argv)
    if named is not None:
        return named
    if any(Path(arg).name == "accelerate" for arg in argv[:2]):
        try:
            from accelerate.commands.config import default_config_file

            if Path(default_config_file).is_file():
                return str(default_config_file)
        except ImportError:
            pass
    return "the accelerate launch config"


def config_file_flag(argv: list[str]) -> str | None:
    """The value of `--config_file` (or `--config-file`) in an `accelerate launch` command line, if given."""
    for i, arg in enumerate(argv):
        for flag in ("--config_file", "--config-file"):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None
