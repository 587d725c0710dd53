"""Fine-tune a verifier's own MTP (multi-token-prediction) layer as its drafter, on the verifier's hidden states.

    accelerate launch train/mtp.py --config configs/glm4-moe-mtp.yaml
    accelerate launch train/mtp.py --config configs/glm4-moe-mtp.yaml --verifier=/models/GLM-4.5-Air --mtp.steps=3

(`python train/mtp.py ...` and `draftheads train mtp ...` are the same run in one process.)

`verifier` is a checkpoint that ships its MTP layer (FAMILIES in models/layouts/mtp_checkpoint.py: glm4_moe, GLM-4.5
/ 4.6 / 4.7); the layer starts from its shipped weights (`mtp.init: shipped`). The run folder (`output_dir`) gets
config.yaml, metrics.jsonl, resumable step-NNNNNN/ checkpoints (the layer only) and drafter/: the verifier's
checkpoint with the fine-tuned MTP layer under the checkpoint's own names (unchanged files hard-linked), which vLLM
serves as the target model itself:

    LLM(model="RUN/drafter", speculative_config={"method": "glm4_moe_mtp", "num_speculative_tokens": 3})

In order (the layer, its step and loss live in models/mtp/):
  1. the frozen verifier and its tokenizer; fixed-length token rows of the training and held-out data;
  2. the MTP layer read from the verifier's checkpoint, AdamW over all of it (the embedding and LM head, shared
     with the verifier, stay frozen), the warm-up + cosine schedule, one `accelerator.prepare`;
  3. per micro-batch: one verifier forward under no-grad (final hidden states; logits for `mtp.targets:
     verifier`), `mtp.steps` unrolled drafts from every position, the decayed cross-entropy, `loop.step`;
  4. held-out evaluation every `train.eval_every` steps and at the end: per-draft accuracy (conditional,
     cumulative) and the simulated acceptance length;
  5. the export (drafter/, its `draftheads` block in draftheads_mtp.json);
  6. the train/serve check: the export, reloaded from disk, drafts `mtp.num_draft_tokens` per step through our
     engine and must accept exactly what the in-memory layer accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftheads.data.progress import quiet
from draftheads.models.export import export_mtp
from draftheads.models.layouts.mtp_checkpoint import FAMILIES, MtpCheckpointError, read_mtp_layer
from draftheads.models.mtp import MtpConfig, MtpDrafter, MtpError
from draftheads.models.mtp.drafter import shift_left
from draftheads.models.verifier import resolve_verifier
from draftheads.train.cli import main_guard
from draftheads.train.config import ConfigError, RunConfig
from draftheads.train.features import batch_tokens, feature_source
from draftheads.train.finish import finish_run
from draftheads.train.heldout import chain_eval_values, chain_sums, heldout_sums
from draftheads.train.loaders import get_dataloaders
from draftheads.train.loop import TrainLoop
from draftheads.train.optim import build_optimizer, cosine_schedule
from draftheads.train.placement import export_drafter, load_verifier
from draftheads.train.run_folder import record_run_resolved
from draftheads.train.tracking import build_accelerator, start_tracking


@dataclass
class MtpRunConfig(RunConfig):
    """A run fine-tuning the verifier's own MTP layer."""

    output_dir: str = "runs/mtp"
    """Run folder: config.yaml, metrics.jsonl, step-NNNNNN/ checkpoints and, in drafter/, the verifier checkpoint
    with the fine-tuned MTP layer."""
    mtp: MtpConfig = field(default_factory=MtpConfig)
    """The unrolled drafts, their loss weights and targets, and where the layer starts."""

    def __post_init__(self):
        super().__post_init__()
        if self.features != "online":
            raise ConfigError("features=offline: the MTP trainer reads the verifier's hidden states online only "
                              "(set features: online)")
        if self.mtp.steps + 1 >= self.data.seq_len:
            raise ConfigError(f"mtp.steps={self.mtp.steps} needs rows longer than steps + 1 tokens; "
                              f"data.seq_len={self.data.seq_len}")


class MtpTrainModule(torch.nn.Module):
    """The drafter behind one `forward` (what accelerate wraps): the unrolled training step."""

    def __init__(self, drafter: MtpDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, hidden, loss_mask, labels, position_ids=None):
        return self.drafter.train_forward(input_ids, hidden, loss_mask, labels, position_ids)


def step_metrics(out) -> dict[str, torch.Tensor]:
    """Per-batch train metrics, device scalars: accuracy of each draft, acceptance length, per-step losses."""
    summary = out.counts.summary()
    metrics = {f"acc_{k + 1}": acc for k, acc in enumerate(summary["acc"])}
    metrics["accept_length"] = summary["accept_length"]
    metrics.update({f"step_loss_{k + 1}": loss for k, loss in enumerate(out.step_losses)})
    return metrics


def main(cfg: MtpRunConfig) -> dict:
    """Train, evaluate and export; returns the training summary stored in the export (main process)."""
    accelerator = build_accelerator(cfg)
    say = (lambda message: None) if quiet() else accelerator.print

    try:  # the checkpoint's own MTP layer, before the verifier (a large model) is loaded
        weights = read_mtp_layer(resolve_verifier(cfg.verifier))
    except MtpCheckpointError as err:
        raise ConfigError(str(err)) from None
    verifier, tokenizer = load_verifier(cfg, accelerator.device, accelerator)
    try:
        drafter = MtpDrafter(verifier, weights, cfg.mtp)
    except MtpError as err:
        raise ConfigError(str(err)) from None
    weights_folder, family, layer = weights.folder, weights.model_type, weights.layer_index
    del weights  # the layer's stored tensors (GB for a real MoE layer): the drafter holds its own copy now
    train_dl, eval_dl = get_dataloaders(cfg, tokenizer)
    start_tracking(accelerator, cfg)
    say(f"[data] {len(train_dl.dataset)} training rows, {len(eval_dl.dataset)} held-out rows of "
        f"{cfg.data.seq_len} tokens ({cfg.data.source})")
    record_run_resolved(accelerator, cfg, "mtp", {**cfg.mtp.to_dict(), "family": family, "layer_index": layer})
    n_params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    say(f"[mtp] {family} layer model.layers.{layer} ({cfg.mtp.init}), "
        f"{n_params / 1e6:.2f}M trainable parameters, {cfg.mtp.steps} unrolled drafts, targets {cfg.mtp.targets}; "
        f"served by vLLM as {FAMILIES[family]}")

    model = MtpTrainModule(drafter)
    optimizer = build_optimizer(model, cfg)
    scheduler = cosine_schedule(optimizer, cfg)
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    accelerator.register_for_checkpointing(scheduler)
    features = feature_source(cfg, verifier, return_logits=cfg.mtp.targets == "verifier")

    def inputs(batch: dict):
        """(final hidden states (B, T, H), labels (B, T): the token that should follow each position)."""
        feats = features(batch)  # frozen verifier, no grad
        labels = feats.logits.argmax(-1) if cfg.mtp.targets == "verifier" else shift_left(batch["input_ids"], 1)
        return feats.final, labels

    # ---- held-out evaluation ----
    def measure(batch: dict) -> dict[str, torch.Tensor]:
        final, labels = inputs(batch)
        out = model(batch["input_ids"], final, batch["loss_mask"], labels, batch.get("position_ids"))
        return chain_sums(out, out.counts)

    def evaluate() -> dict[str, float]:
        sums = heldout_sums(accelerator, model, eval_dl, cfg.train.eval_batches, measure)
        if not sums:
            return {}
        values, acc = chain_eval_values(accelerator, sums, loop.state.step, "step", first=1)
        loop.print(f"[eval] step {loop.state.step}: held-out accuracy per draft {' '.join(f'{a:.3f}' for a in acc)}, "
                   f"simulated acceptance length {values['eval/accept_length']:.3f}")
        return values

    # ---- the loop ----
    loop = TrainLoop(accelerator, cfg, model, optimizer, scheduler, train_dl, evaluate=evaluate)
    loop.resume()
    for batch in loop.batches():
        final, labels = inputs(batch)  # outside the accumulate block: no grad
        with accelerator.accumulate(model):
            out = model(batch["input_ids"], final, batch["loss_mask"], labels, batch.get("position_ids"))
            accelerator.backward(out.loss)
            loop.step(out.loss, step_metrics(out), tokens=batch_tokens(batch))
    loop.finish()
    loop.final_evaluation()

    # ---- export ----
    summary = {**loop.summary(), "data": cfg.data.source, "seq_len": cfg.data.seq_len}
    drafter = export_drafter(accelerator, model, "float32",  # a fresh copy, read again (the tensors were let go)
                             lambda: MtpTrainModule(MtpDrafter(verifier, read_mtp_layer(weights_folder), cfg.mtp)))
    if accelerator.is_main_process:
        folder = export_mtp(drafter, cfg.drafter_dir, verifier, training=summary)
        say(f"[export] {folder}: the verifier checkpoint with the fine-tuned MTP layer (vLLM: method "
            f"{FAMILIES[family]})")
    return finish_run(accelerator, loop, summary, cfg, drafter, verifier, eval_dl.dataset, tokenizer, say=say,
                      num_draft_tokens=cfg.mtp.num_draft_tokens)


if __name__ == "__main__":
    main_guard(main, MtpRunConfig)
