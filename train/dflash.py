"""Train a DFlash drafter (block-diffusion drafting) on a frozen verifier's hidden states.

    accelerate launch train/dflash.py --config configs/dflash-tiny.yaml
    accelerate launch train/dflash.py --config configs/dflash-tiny.yaml --dflash.block_size=8 --train.max_steps=50
    accelerate launch --multi_gpu --num_processes 8 train/dflash.py --config configs/qwen3-8b-dflash.yaml

(`python train/dflash.py ...` and `draftheads train dflash ...` are the same run in one process.)

The run folder (`output_dir`) gets config.yaml, metrics.jsonl, resumable step-NNNNNN/ checkpoints (a rerun of the
same command continues from the newest) and drafter/, z-lab's layout that vLLM (`method: dflash`) and SGLang
(`--speculative-algorithm DFLASH`) load (`engine: speculators` writes the speculators format instead). DSpark:
`--dflash.markov_rank=R` adds the Markov and confidence heads (models/dflash/dspark.py) and exports vLLM's
Qwen3DSparkModel (`method: dspark`).

In order (the drafter, its anchored blocks and loss live in models/dflash/):
  1. the frozen verifier and its tokenizer; fixed-length token rows of the training and held-out data;
  2. the drafter (its layer sizes, target layers and mask token resolved from the verifier's config), AdamW, the
     warm-up + cosine schedule, and one `accelerator.prepare`;
  3. per micro-batch: verifier features (online: one verifier forward under no-grad keeping only the target layers'
     outputs; offline: the hidden-state cache), `dflash.num_anchors` random anchored blocks per row in one drafter
     forward, the decayed cross-entropy, backward, `loop.step` (clip, optimizer, schedule, logs, checkpoints);
  4. held-out evaluation every `train.eval_every` steps and at the end: per block position accuracy against the
     verifier's greedy token, conditional and cumulative, and the simulated acceptance length (eval/...);
  5. the export, with a training summary in its `draftheads` metadata;
  6. the train/serve check (`consistency` section, train/finish.py): the export, reloaded from disk, decodes
     held-out prompts through our engine; its tau is logged as eval/tau, and a difference from the in-memory
     drafter's (eval/tau_in_memory) exits non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftheads.data.progress import quiet
from draftheads.models.dflash import DFlashConfig, DFlashTrainModule
from draftheads.models.dflash2 import build_drafter  # either dflash.variant's drafter
from draftheads.models.export import check_dflash_engine, check_dflash_verifier, export_dflash
from draftheads.train.cli import main_guard
from draftheads.train.config import ConfigError, ExportedRunConfig
from draftheads.train.features import batch_tokens, feature_source
from draftheads.train.finish import finish_run
from draftheads.train.heldout import chain_eval_values, chain_sums, heldout_sums
from draftheads.train.loaders import draft_vocab_counts, get_dataloaders
from draftheads.train.loop import TrainLoop
from draftheads.train.optim import build_optimizer, cosine_schedule
from draftheads.train.placement import export_drafter, load_verifier
from draftheads.train.run_folder import record_run_resolved
from draftheads.train.tracking import build_accelerator, start_tracking
from draftheads.train.zero import engine_line


@dataclass
class DFlashRunConfig(ExportedRunConfig):
    """A DFlash drafter training run."""

    output_dir: str = "runs/dflash"
    """Run folder: config.yaml, metrics.jsonl, step-NNNNNN/ checkpoints and the exported drafter in drafter/."""
    dflash: DFlashConfig = field(default_factory=DFlashConfig)
    """The drafter: layers, block size, target layers, mask token, anchors and the loss decay."""

    def __post_init__(self):
        super().__post_init__()
        try:
            check_dflash_engine(self.dflash, self.engine)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.dflash.block_size > self.data.seq_len:
            raise ConfigError(f"dflash.block_size={self.dflash.block_size} > data.seq_len={self.data.seq_len}: a "
                              "block would not fit in a training row; lower the block or raise data.seq_len")


def step_metrics(out) -> dict[str, torch.Tensor]:
    """Per-batch train metrics, device scalars: accuracy of each block position, acceptance length, losses."""
    summary = out.counts.summary()
    metrics = {f"acc_{k + 1}": acc for k, acc in enumerate(summary["acc"])}
    metrics["accept_length"] = summary["accept_length"]
    metrics.update({f"pos_loss_{k + 1}": loss for k, loss in enumerate(out.step_losses)})
    return metrics


def main(cfg: DFlashRunConfig) -> dict:
    """Train, evaluate and export; returns the training summary stored in the export (main process)."""
    accelerator = build_accelerator(cfg)
    say = (lambda message: None) if quiet() else accelerator.print

    verifier, tokenizer = load_verifier(cfg, accelerator.device, accelerator)
    try:
        check_dflash_verifier(cfg.engine, verifier)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    train_dl, eval_dl = get_dataloaders(cfg, tokenizer)
    start_tracking(accelerator, cfg)  # wandb only now: the verifier, its tokenizer and the data passed their checks
    say(f"[data] {len(train_dl.dataset)} training rows, {len(eval_dl.dataset)} held-out rows of "
        f"{cfg.data.seq_len} tokens ({cfg.data.source})")

    # Its own lm_head (dflash.draft_vocab_size): the draft vocabulary is the most frequent training targets, as
    # EAGLE-3's (counted in the data; with dflash.targets=verifier the targets are the verifier's greedy tokens, of
    # which the data's are the estimate the counts can have before any verifier forward).
    token_counts = None
    if cfg.dflash.draft_vocab_size is not None:
        token_counts = draft_vocab_counts(train_dl.dataset, verifier.vocab_size)
    drafter = build_drafter(verifier, cfg.dflash, token_counts=token_counts)
    dc = drafter.cfg
    if token_counts is not None:
        coverage = float(token_counts[drafter.t2d.cpu()].sum() / token_counts.sum().clamp(min=1))
        say(f"[dflash] own lm_head over {dc.draft_vocab_size} of {verifier.vocab_size} tokens, covering "
            f"{coverage:.1%} of the training data's tokens")
    # the nulls as this version fills them (mask token, target layers, sizes): a continued run must agree
    record_run_resolved(accelerator, cfg, "dflash", dc.to_dict())
    n_params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    say(f"[dflash] {n_params / 1e6:.2f}M trainable parameters, {dc.num_hidden_layers} layers, block {dc.block_size}, "
        f"target layers {dc.target_layer_ids}, mask token {dc.mask_token_id}, loss "
        f"{f'dpace alpha {dc.loss_alpha:g}' if dc.loss == 'dpace' else f'{dc.loss} gamma {dc.loss_gamma:g}'} "
        f"({cfg.features} features)"
        + (f"; DSpark: Markov head of rank {dc.markov_rank}"
           f"{', confidence head' if dc.has_confidence_head else ''}" if dc.dspark else ""))

    model = DFlashTrainModule(drafter)
    optimizer = build_optimizer(model, cfg)
    scheduler = cosine_schedule(optimizer, cfg)
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    if (engine := engine_line(model)) is not None:  # DeepSpeed: which engine trains, stated
        accelerator.print(engine)
    accelerator.register_for_checkpointing(scheduler)
    features = feature_source(cfg, verifier, layer_ids=drafter.feature_layers)
    # Anchors come from torch's global RNG, which the checkpoints save and restore, so a resumed run draws what the
    # uninterrupted one would have drawn.

    # ---- held-out evaluation: counts summed over batches and processes, turned into rates once ----
    def measure(batch: dict) -> dict[str, torch.Tensor]:
        # Held-out anchors from a generator seeded per evaluation, so every evaluation scores the same blocks.
        out = model(batch["input_ids"], features(batch), batch["loss_mask"], generator=eval_generator,
                    position_ids=batch.get("position_ids"))  # packed rows: restarting per document
        return chain_sums(out, out.counts)

    eval_generator = torch.Generator()

    def evaluate() -> dict[str, float]:
        eval_generator.manual_seed(cfg.train.seed + accelerator.process_index)
        sums = heldout_sums(accelerator, model, eval_dl, cfg.train.eval_batches, measure)
        if not sums:
            return {}
        values, acc = chain_eval_values(accelerator, sums, loop.state.step, "position", first=1)
        values.update({f"eval/pos_loss_{k + 1}": v
                       for k, v in enumerate((sums["step_losses"] / sums["batches"]).tolist())})
        loop.print(f"[eval] step {loop.state.step}: held-out accuracy per block position "
                   f"{' '.join(f'{a:.3f}' for a in acc)}, simulated acceptance length "
                   f"{values['eval/accept_length']:.3f}")
        return values

    # ---- the loop ----
    loop = TrainLoop(accelerator, cfg, model, optimizer, scheduler, train_dl, evaluate=evaluate)
    loop.resume()
    for batch in loop.batches():
        feats = features(batch)  # frozen verifier, no grad: outside the autocast/accumulate block on purpose
        with accelerator.accumulate(model):
            out = model(batch["input_ids"], feats, batch["loss_mask"], position_ids=batch.get("position_ids"))
            accelerator.backward(out.loss)
            loop.step(out.loss, step_metrics(out), tokens=batch_tokens(batch))
    loop.finish()
    loop.final_evaluation()  # unless the last step ran one

    # ---- export ----
    summary = {**loop.summary(), "data": cfg.data.source, "seq_len": cfg.data.seq_len}
    # Whole weights (gathered when FSDP / ZeRO-3 sharded them); a fresh copy then, built like the trained one.
    drafter = export_drafter(accelerator, model, cfg.export_dtype,
                             lambda: DFlashTrainModule(build_drafter(verifier, cfg.dflash, token_counts=token_counts)))
    if accelerator.is_main_process:
        folder = export_dflash(drafter, cfg.drafter_dir, verifier, training=summary, engine=cfg.engine)
        say(f"[export] {folder} ({cfg.engine}, {cfg.export_dtype})")
    # Train/serve consistency: the export, reloaded from disk, must accept what the in-memory drafter accepts.
    return finish_run(accelerator, loop, summary, cfg, drafter, verifier, eval_dl.dataset, tokenizer, say=say)


if __name__ == "__main__":
    main_guard(main, DFlashRunConfig)
