"""The pieces both trainers share: accelerator, verifier + tokenizer, data loaders, optimizer and schedule, and
`TrainLoop`, which owns the optimizer-step bookkeeping (numerical guard, clipping, logging, evaluation cadence,
checkpoints and resume) so `train/medusa.py` and `train/eagle.py` only say what is specific to their method:

    loop = TrainLoop(accelerator, cfg, drafter, optimizer, scheduler, train_dl, evaluate=...)
    loop.resume()
    for batch in loop.batches():
        with accelerator.accumulate(drafter):
            loss, metrics = ...                      # method-specific
            accelerator.backward(loss)
            loop.step(loss, metrics)                 # optimizer step on gradient-sync micro-batches
    loop.finish()

Held-out evaluation is the trainer's `evaluate` callback; `heldout_sums` runs the shared part (eval mode, no grad,
a bounded number of batches, sums reduced over processes), and `loop.summary()` is what a run reports at the end.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from data.progress import quiet
from eval.report import wandb_mode
from train.checkpoint import (TrainState, complete_checkpoints, load_checkpoint, resolve_resume, save_checkpoint,
                              step_dir)
from train.config import ConfigError, RunConfig, config_dict, save_config


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss; the last good checkpoint is intact."""


# ---- accelerator, verifier, data -------------------------------------------------------------------------------
def build_accelerator(cfg: RunConfig):
    """One Accelerator per run: mixed precision, gradient accumulation, wandb tracking (offline without a key)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if cfg.train.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("train.mixed_precision=fp16 needs a CUDA GPU; use `bf16` or `no` on the CPU")
    log_with = "wandb" if cfg.wandb.enabled else None
    accelerator = Accelerator(
        mixed_precision=cfg.train.mixed_precision,
        gradient_accumulation_steps=cfg.train.grad_accum,
        log_with=log_with,
        project_dir=cfg.output_dir,
        step_scheduler_with_optimizer=False,  # we step the schedule once per optimizer step, whatever the world size
    )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes != launched:
        # `accelerate launch --multi_gpu` on a machine without GPUs starts N independent single-process runs that
        # would all write output_dir; refuse instead of training N unsynchronised copies.
        raise ConfigError(
            f"launched as {launched} processes (WORLD_SIZE={launched}) but Accelerate set up "
            f"{accelerator.num_processes} ({accelerator.distributed_type}); without GPUs set ACCELERATE_USE_CPU=true "
            "(or `accelerate launch --cpu --num_processes N`) so the processes train together over gloo")
    if accelerator.gradient_accumulation_steps != cfg.train.grad_accum:
        # A launch config (DeepSpeed's gradient_accumulation_steps, ACCELERATE_GRADIENT_ACCUMULATION_STEPS) overrides
        # the argument; the global batch would silently differ from the run config's.
        raise ConfigError(
            f"the accelerate launch config sets gradient_accumulation_steps={accelerator.gradient_accumulation_steps} "
            f"but train.grad_accum={cfg.train.grad_accum}; make them equal")
    set_seed(cfg.train.seed)
    if log_with:
        init_wandb(accelerator, cfg)
    if accelerator.is_main_process:
        save_config(cfg, cfg.output_dir)
    return accelerator


def init_wandb(accelerator, cfg: RunConfig) -> None:
    project = cfg.wandb.project or os.environ.get("WANDB_PROJECT") or "draftheads"
    init_kwargs = {"name": cfg.wandb.run_name or Path(cfg.output_dir).name, "dir": cfg.output_dir,
                   "mode": wandb_mode() if cfg.wandb.mode == "auto" else cfg.wandb.mode}
    if cfg.wandb.entity:
        init_kwargs["entity"] = cfg.wandb.entity
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    accelerator.init_trackers(project, config=config_dict(cfg), init_kwargs={"wandb": init_kwargs})


def log_table(accelerator, key: str, columns: list[str], rows: list[list], step: int | None = None) -> None:
    """A wandb table (e.g. per-head accuracy) at `step` (the training step; None: wandb's own counter); no-op
    without wandb. Main process only."""
    if not accelerator.is_main_process or not accelerator.log_with:
        return
    import wandb

    tracker = accelerator.get_tracker("wandb", unwrap=True)
    tracker.log({key: wandb.Table(columns=columns, data=rows)}, step=step)


def load_verifier(cfg: RunConfig, device, accelerator=None):
    """The frozen verifier and its tokenizer, checked against each other.

    With `accelerator` the verifier is placed for the launch config (`shard_verifier`): under FSDP it is read on the
    CPU and its decoder layers are sharded onto `device` one at a time, so no device ever holds all of it.
    """
    from transformers import AutoTokenizer

    from models.verifier import Verifier, VerifierError

    shard = accelerator is not None and verifier_sharded_by(accelerator)
    verifier = Verifier.from_pretrained(cfg.verifier, dtype=cfg.verifier_dtype, device="cpu" if shard else device,
                                        trust_remote_code=cfg.trust_remote_code)
    if shard:
        shard_verifier(verifier, accelerator, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(verifier.path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise VerifierError(f"verifier folder {str(verifier.path)!r}: cannot load its tokenizer ({err})") from None
    context = getattr(verifier.config, "max_position_embeddings", None)
    if context and cfg.data.seq_len > context:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is longer than the verifier's context ({str(verifier.path)!r}: "
            f"max_position_embeddings={context}); set data.seq_len <= {context}")
    if len(tokenizer) > verifier.vocab_size:
        raise VerifierError(
            f"tokenizer of {str(verifier.path)!r} has {len(tokenizer)} tokens but the verifier's vocab_size is "
            f"{verifier.vocab_size}; the tokenizer does not belong to this model")
    return verifier, tokenizer


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether some parameter of `module` is an FSDP2 shard (a DTensor): its local tensors are not the weights."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def verifier_sharded_by(accelerator) -> bool:
    """Whether the launch config shards the frozen verifier: FSDP with more than one process."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP and accelerator.num_processes > 1


def shard_verifier(verifier, accelerator, device=None) -> bool:
    """Under an FSDP launch config, shard the frozen verifier's decoder layers over the processes
    (`fully_shard_verifier`) onto `device` (default: accelerator.device); under any other backend leave it as it
    is. Returns whether it sharded. The one place where the verifier's placement depends on the backend."""
    if not verifier_sharded_by(accelerator):
        return False
    if not accelerator.is_fsdp2:  # FSDP1 would gather the drafter on rank 0 only; the check needs it everywhere
        raise ConfigError("the FSDP launch config sets fsdp_version: 1; draftheads needs fsdp_version: 2 "
                          "(configs/accelerate/fsdp.yaml)")
    fully_shard_verifier(verifier, device=torch.device(device or accelerator.device))
    return True


def fully_shard_verifier(verifier, mesh=None, device: torch.device | None = None) -> None:
    """Shard each decoder layer of a frozen verifier over the default process group with FSDP2 (`fully_shard`).

    A layer's weights are all-gathered just before its forward and freed after it (reshard_after_forward), so a
    process holds 1/N of the decoder stack plus one layer at a time. The token embedding, the final norm and
    lm_head stay whole on every process: drafters read them directly (`verifier.lm_head.weight`, EAGLE's held
    embedding, Medusa's head initialisation) and they are small next to the layers. The decoder gets a root
    `fully_shard` that manages no parameters (all of its own are ignored), so that the layers are not roots (FSDP2
    keeps a root's weights gathered after forward). Collective: every process calls it, with the same verifier.
    Forward hooks on the layers (`Verifier.features`' layer inputs) see the layer inputs as before.

    A verifier on the CPU with `device` a GPU: each layer is moved to the device as it is sharded (one whole layer
    there at a time), then the unsharded rest (embedding, norm, lm_head, buffers) follows.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    device = torch.device(device) if device is not None else verifier.device
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in verifier.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    whole = {p for name, p in verifier.decoder.named_parameters() if not name.startswith("layers.")}
    fully_shard(verifier.decoder, mesh=mesh, reshard_after_forward=True, ignored_params=whole)
    with torch.no_grad():
        for tensor in [*verifier.model.parameters(), *verifier.model.buffers()]:
            if not isinstance(tensor, DTensor) and tensor.device != device:
                tensor.data = tensor.to(device)  # in place: tied embedding / lm_head stay one tensor


def sharded_weights(accelerator) -> bool:
    """Whether the launch config shards the weights of what `accelerator.prepare` wraps (FSDP, DeepSpeed ZeRO-3)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    return (accelerator.distributed_type == DistributedType.DEEPSPEED
            and accelerator.deepspeed_config["zero_optimization"]["stage"] == 3)


def unsharded(accelerator, model: torch.nn.Module, build: Callable[[], torch.nn.Module]) -> torch.nn.Module | None:
    """The trained module with whole weights, for export, scoring outside `forward` and the train/serve check.

    Under DDP, ZeRO-1/2 or one process that is `accelerator.unwrap_model(model)` itself. When the weights are
    sharded (FSDP, DeepSpeed ZeRO-3) the full state dict is gathered (collective: every process calls this) and
    loaded into a fresh unsharded copy made by `build()` (same class and shapes as the unwrapped module): under
    FSDP on every process (the verifier may be sharded too, so the check runs everywhere), under ZeRO-3 on the
    main process only (None elsewhere; DeepSpeed gathers to rank 0).
    """
    inner = accelerator.unwrap_model(model)
    if is_sharded(inner):  # FSDP2 (accelerate's fsdp_version: 2): DTensor parameters
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    elif sharded_weights(accelerator):
        state = accelerator.get_state_dict(model)  # FSDP1 / ZeRO-3: the full tensors on the main process
        if not accelerator.is_main_process:
            return None
    else:
        return inner
    copy = build().to(accelerator.device)
    copy.load_state_dict({k: v.to(accelerator.device) for k, v in state.items()})
    return copy.train(inner.training)


class EpochSampler(Sampler[int]):
    """A shuffle that depends only on (seed, epoch): the same order on every process and after every resume."""

    def __init__(self, length: int, seed: int, shuffle: bool = True):
        self.length, self.seed, self.shuffle, self.epoch = length, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.length))
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.length, generator=generator).tolist())

    def __len__(self) -> int:
        return self.length


def make_dataloaders(train_ds, eval_ds, cfg: RunConfig, collate: Callable) -> tuple[DataLoader, DataLoader]:
    """Loaders over tokenised datasets; drop_last so every process sees whole batches."""
    if len(train_ds) < cfg.train.batch_size:
        raise ValueError(
            f"training data has {len(train_ds)} sequences, fewer than train.batch_size={cfg.train.batch_size}; "
            "add data or lower the batch size")
    # Own generators: a loader without one draws its workers' base seed from the global RNG each time an iterator
    # starts, so a resumed run (one more iterator after the RNG state is restored) would draw different noise/dropout.
    train_dl = DataLoader(train_ds, batch_size=cfg.train.batch_size, sampler=EpochSampler(len(train_ds), cfg.train.seed),
                          collate_fn=collate, drop_last=True, num_workers=cfg.train.num_workers,
                          generator=torch.Generator().manual_seed(cfg.train.seed))
    eval_dl = DataLoader(eval_ds, batch_size=cfg.train.batch_size, shuffle=False, collate_fn=collate,
                         num_workers=cfg.train.num_workers, generator=torch.Generator().manual_seed(cfg.train.seed))
    return train_dl, eval_dl


def get_dataloaders(cfg: RunConfig, tokenizer) -> tuple[DataLoader, DataLoader]:
    """Tokenised train / held-out loaders for a run (a test can call `make_dataloaders` with its own data)."""
    if cfg.features == "offline":  # the cached rows (the same rows, same order) with their verifier features
        from data.hidden_states import cached_datasets, collate_cached

        return make_dataloaders(*cached_datasets(cfg), cfg, collate_cached)
    from data.batching import build_datasets, collate

    train_ds, eval_ds = build_datasets(cfg.data, tokenizer, seed=cfg.train.seed)
    return make_dataloaders(train_ds, eval_ds, cfg, collate)


# ---- optimisation -----------------------------------------------------------------------------------------------
def build_optimizer(param_groups, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (a module, an iterable of tensors, or param-group dicts)."""
    if isinstance(param_groups, torch.nn.Module):
        param_groups = [p for p in param_groups.parameters() if p.requires_grad]
    return torch.optim.AdamW(param_groups, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                             weight_decay=cfg.train.weight_decay)


def cosine_schedule(optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to each group's lr, then cosine decay to lr x min_lr_ratio at max_steps."""
    warmup, total, floor = cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---- the loop ---------------------------------------------------------------------------------------------------
class TrainLoop:
    """Optimizer-step bookkeeping shared by the trainers.

    `batches()` yields micro-batches from where the run left off (epochs reshuffled by (seed, epoch), the consumed
    part of the current epoch skipped on resume) until `train.max_steps` optimizer steps are done. `step(loss,
    metrics)` is called once per micro-batch after backward: on the micro-batch that syncs gradients it checks the
    loss is finite (the one host sync per optimizer step), clips, steps optimizer and schedule, logs every
    `log_every` steps, evaluates every `eval_every`, and checkpoints every `save_every`.
    Metrics are summed on the device between log steps.
    """

    def __init__(self, accelerator, cfg: RunConfig, model, optimizer, scheduler, train_dl: DataLoader,
                 evaluate: Callable[[], dict[str, float]] | None = None, clip_params=None):
        self.accelerator, self.cfg = accelerator, cfg
        self.model, self.optimizer, self.scheduler, self.train_dl = model, optimizer, scheduler, train_dl
        self.evaluate = evaluate
        self.clip_params = clip_params
        self.state = TrainState()
        self.output_dir = Path(cfg.output_dir)
        self._finite = torch.ones((), dtype=torch.bool, device=accelerator.device)
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0
        self._consecutive_bad = 0
        self._last_log = time.perf_counter()
        self._tokens = torch.zeros((), device=accelerator.device)
        self.history: list[dict] = []
        self._bar = None
        self._started = time.perf_counter()

    # -- resume --
    def resume(self) -> TrainState:
        path = resolve_resume(self.cfg.train.resume, self.output_dir)
        if path is None:
            if self.cfg.train.resume == "none" and complete_checkpoints(self.output_dir):
                self.print(f"[resume] train.resume=none: starting over; existing checkpoints in "
                           f"{self.output_dir} will be replaced as new ones are written")
            return self.state
        self.state = load_checkpoint(self.accelerator, path)
        self.print(f"[resume] continuing from {path} (step {self.state.step}, epoch {self.state.epoch}, "
                   f"{self.state.consumed} batches into it)")
        return self.state

    # -- data --
    def batches(self) -> Iterator[dict]:
        cfg, state = self.cfg, self.state
        if state.step >= cfg.train.max_steps:
            return
        self._bar = None if quiet() or not self.accelerator.is_main_process else _progress(
            cfg.train.max_steps, state.step, Path(sys.argv[0]).stem or "train")
        while state.step < cfg.train.max_steps:
            self.train_dl.set_epoch(state.epoch)
            loader = self.train_dl
            if state.consumed:
                loader = self.accelerator.skip_first_batches(self.train_dl, state.consumed)
            for batch in loader:
                yield batch
                if state.step >= cfg.train.max_steps:
                    return
            state.epoch += 1
            state.consumed = 0

    # -- one micro-batch --
    def step(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor] | None = None,
             tokens: torch.Tensor | None = None) -> None:
        accelerator, cfg, state = self.accelerator, self.cfg, self.state
        state.consumed += 1
        self._finite &= torch.isfinite(loss.detach())
        for key, value in {"loss": loss, **(metrics or {})}.items():
            value = value.detach().float()
            self._sums[key] = self._sums[key] + value if key in self._sums else value
        self._count += 1
        if tokens is not None:
            self._tokens += tokens.detach()
        if not accelerator.sync_gradients:
            return
        # This is the sync point: one boolean per optimizer step, agreed by all processes.
        finite = bool(accelerator.reduce(self._finite.float(), reduction="mean").item() == 1.0)
        self._finite.fill_(True)
        if finite:
            self._consecutive_bad = 0
            if cfg.train.grad_clip > 0:
                params = self.clip_params if self.clip_params is not None else self.model.parameters()
                accelerator.clip_grad_norm_(params, cfg.train.grad_clip)
            self.optimizer.step()
        else:
            state.bad_steps += 1
            self._consecutive_bad += 1
            self.print(f"[guard] step {state.step + 1}: non-finite loss, update skipped "
                       f"({self._consecutive_bad} in a row, {state.bad_steps} in total)")
            if self._consecutive_bad >= cfg.train.max_bad_steps:
                last = complete_checkpoints(self.output_dir)
                raise NonFiniteLossError(
                    f"{self._consecutive_bad} consecutive steps had a non-finite loss (train.max_bad_steps="
                    f"{cfg.train.max_bad_steps}); stopping. Last good checkpoint: "
                    f"{last[-1] if last else 'none written yet'}. Lower train.lr or check the data.")
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        state.step += 1
        if self._bar is not None:
            self._bar.update(1)
        if state.step % cfg.train.log_every == 0 or state.step == cfg.train.max_steps:
            self._log()
        if cfg.train.eval_every and state.step % cfg.train.eval_every == 0 and self.evaluate:
            self.log(self.evaluate())
        if cfg.train.save_every and state.step % cfg.train.save_every == 0 and not self._consecutive_bad:
            self.save()  # never in the middle of a non-finite streak: the newest checkpoint stays a good one

    def _log(self) -> None:
        if not self._count:
            return
        names = sorted(self._sums)
        means = torch.stack([self._sums[k] for k in names]) / self._count
        means = self.accelerator.reduce(means, reduction="mean")
        now = time.perf_counter()
        tokens = self.accelerator.reduce(self._tokens.clone(), reduction="sum")
        values = dict(zip((f"train/{k}" for k in names), means.tolist()))  # sync point, once per log interval
        values["train/lr"] = self.scheduler.get_last_lr()[0]
        values["train/bad_steps"] = self.state.bad_steps
        if tokens.item() > 0:
            values["train/tokens_per_s"] = tokens.item() / max(now - self._last_log, 1e-9)
        self._sums, self._count, self._last_log = {}, 0, now
        self._tokens.zero_()
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{values['train/loss']:.4f}")
        self.log(values)

    def log(self, values: dict[str, float]) -> None:
        """Log to the trackers and append to `{output_dir}/metrics.jsonl` (main process)."""
        if not values:
            return
        values = {**values}
        self.accelerator.log(values, step=self.state.step)
        if self.accelerator.is_main_process:
            record = {"step": self.state.step, **values}
            self.history.append(record)
            with open(self.output_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    # -- checkpoints --
    def save(self) -> Path:
        return save_checkpoint(self.accelerator, self.output_dir, self.state, self.cfg.train.keep_last)

    def finish(self) -> None:
        """Final checkpoint (unless the last step already wrote one) and progress bar close."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        done = step_dir(self.output_dir, self.state.step)
        if not (done / "COMPLETE").is_file():
            self.save()

    def print(self, message: str) -> None:
        """A line for people (main process, not when quiet), above the progress bar while one is shown."""
        if quiet():
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            self.accelerator.print(message)

    def summary(self) -> dict:
        """Where the run ended and the last logged value of every metric (main process), for the export metadata."""
        last: dict = {}
        for record in self.history:
            last.update(record)
        last.pop("step", None)
        return {"steps": self.state.step, "epochs": self.state.epoch + self.state.consumed / max(1, len(self.train_dl)),
                "bad_steps": self.state.bad_steps, "wall_time_s": round(time.perf_counter() - self._started, 3),
                **last}


# ---- held-out evaluation ----------------------------------------------------------------------------------------
@torch.no_grad()
def heldout_sums(accelerator, model, eval_dl, max_batches: int,
                 measure: Callable[[dict], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Sum `measure(batch)` over the first `max_batches` held-out micro-batches of each process (0: all of them).

    The model runs in eval mode (no dropout, no feature noise) and is put back in its previous mode after. The
    sums (plus `batches`, how many were measured) are reduced over processes, so the caller divides counts by
    counts; nothing syncs to the host here. Collective: every process calls it. Empty held-out data gives {}.
    """
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(eval_dl):
        if max_batches and i >= max_batches:
            break
        values = {**measure(batch), "batches": torch.ones((), device=accelerator.device)}
        for key, value in values.items():
            value = value.detach().float()
            sums[key] = sums[key] + value if key in sums else value
    model.train(was_training)
    if not sums:
        return {}
    return accelerator.reduce(sums, reduction="sum")


def _progress(total: int, initial: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)
