"""Train an EAGLE-1 or EAGLE-3 drafter on a frozen verifier's hidden states.

    accelerate launch train/eagle.py --config configs/eagle3-tiny.yaml
    accelerate launch train/eagle.py --config configs/eagle1-tiny.yaml --train.max_steps=50
    accelerate launch --multi_gpu --num_processes 8 train/eagle.py --config configs/llama3-8b-eagle3.yaml

(`python train/eagle.py ...` is the same run in one process.)

The run folder (`output_dir`) gets config.yaml, metrics.jsonl, resumable step-NNNNNN/ checkpoints (a rerun of the
same command continues from the newest) and drafter/, the folder vLLM loads as the speculative model
(`engine: sglang` writes SGLang's flavour instead; see models/eagle/ for both layouts).

In order (the drafter, the training-time-test unroll and the losses live in models/eagle/):
  1. the frozen verifier and its tokenizer; fixed-length token rows of the training and held-out data;
  2. EAGLE-3 only: the draft vocabulary, the `eagle.draft_vocab_size` tokens most often *trained on* (counted at
     loss-masked positions of every training row, identically on every process, so no broadcast is needed);
  3. the drafter, AdamW, the warm-up + cosine schedule, and one `accelerator.prepare`;
  4. per micro-batch: verifier features (online: one verifier forward under no-grad keeping only the layers the
     drafter reads), the drafter's loss, backward, `loop.step` (clip, optimizer, schedule, logs, checkpoints);
     packed rows carry position_ids that restart per document, so neither forward attends across a document
     boundary and no prediction is trained on another document's token (data/documents.py);
  5. held-out evaluation every `train.eval_every` steps and at the end: per-step accuracy against the verifier's
     greedy token, conditional and cumulative, and the simulated acceptance length, logged as eval/... (EAGLE-1
     trains one step but is scored on the `eagle.ttt_steps`-token chains it drafts from its own outputs);
  6. the export, with a training summary in its `draftheads` metadata;
  7. the train/serve check (`consistency` section, train/finish.py): the export, reloaded from disk, decodes
     held-out prompts through our engine; its tau is logged as eval/tau, and a difference from the in-memory
     drafter's (eval/tau_in_memory) exits non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftheads.data.progress import quiet
from draftheads.models.eagle import EagleConfig, EagleOutput, EagleTrainModule, build_drafter
from draftheads.eval.drafters.eagle import TREE_TOP_K
from draftheads.models.export import check_eagle_engine, export_eagle
from draftheads.train.cli import main_guard
from draftheads.train.config import ConfigError, ExportedRunConfig
from draftheads.train.finish import finish_run
from draftheads.train.features import batch_tokens, cache_stores_argmax, feature_source
from draftheads.train.heldout import chain_eval_values, chain_sums, heldout_sums
from draftheads.train.loaders import draft_vocab_counts, get_dataloaders
from draftheads.train.loop import TrainLoop
from draftheads.train.optim import build_optimizer, cosine_schedule
from draftheads.train.placement import export_drafter, load_verifier, sharded_weights
from draftheads.train.run_folder import record_run_resolved
from draftheads.train.tracking import build_accelerator, start_tracking
from draftheads.train.zero import engine_line


@dataclass
class EagleRunConfig(ExportedRunConfig):
    """An EAGLE-1 / EAGLE-3 drafter training run."""

    output_dir: str = "runs/eagle"
    """Run folder: config.yaml, metrics.jsonl, step-NNNNNN/ checkpoints and the exported drafter in drafter/."""
    eagle: EagleConfig = field(default_factory=EagleConfig)
    """The drafter: version, feature layers, draft vocabulary, TTT steps and loss weights."""
    num_speculative_tokens: int = 3
    """engine=speculators: the draft tokens per step written into the export (what vLLM drafts when it serves the
    folder directly)."""

    def __post_init__(self):
        super().__post_init__()
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens={self.num_speculative_tokens}: expected at least 1")
        check_eagle_engine(self.eagle, self.engine)  # the engine's defaults, and what it would serve wrong
        seq_len, eagle = self.data.seq_len, self.eagle
        if eagle.ttt_steps > seq_len - 2:  # step k at position t predicts token t+k+2 of the row
            what = "training-time-test step" if eagle.version == 3 else "scored draft step"
            raise ConfigError(f"eagle.ttt_steps={eagle.ttt_steps} with data.seq_len={seq_len}: each {what} k predicts "
                              f"token t+k+2, so steps past {seq_len - 2} would have no target in a row; set "
                              f"eagle.ttt_steps <= {seq_len - 2} or raise data.seq_len")
        small = eagle.version == 3 and not eagle.parallel and eagle.draft_vocab_size is not None
        if small and eagle.draft_vocab_size < TREE_TOP_K:
            raise ConfigError(f"eagle.draft_vocab_size={eagle.draft_vocab_size}: the dynamic draft tree (the engine's "
                              f"and the train/serve check's) takes the top {TREE_TOP_K} draft tokens at each node; "
                              f"expected at least {TREE_TOP_K} (or null: the whole vocabulary)")


def step_metrics(out: EagleOutput) -> dict[str, torch.Tensor]:
    """Per-batch train metrics, device scalars: accuracy of each TTT step, acceptance length, loss parts."""
    summary = out.counts.summary()
    metrics = {f"acc_{k}": acc for k, acc in enumerate(summary["acc"])}
    metrics["accept_length"] = summary["accept_length"]
    if len(out.step_losses) > 1:
        metrics.update({f"step_loss_{k}": loss for k, loss in enumerate(out.step_losses)})
    return {**metrics, **out.parts}


def hold_draft_rows(cfg: EagleRunConfig, drafter, verifier) -> bool:
    """An EAGLE-3 run on a feature cache that stores the verifier's argmax, holding the verifier head-only: the
    cache's argmax stands in for the whole head, so the verifier keeps only the draft vocabulary's rows of lm_head
    (`Eagle3Drafter.hold_draft_rows`). True when rows were freed."""
    if cfg.eagle.version == 3 and verifier.head_only and cache_stores_argmax(cfg):
        drafter.hold_draft_rows(verifier)
    return not verifier.holds_whole_head


def main(cfg: EagleRunConfig) -> dict:
    """Train, evaluate and export; returns the training summary stored in the export (main process)."""
    accelerator = build_accelerator(cfg)
    say = (lambda message: None) if quiet() else accelerator.print
    if cfg.train.optimizer == "muon" and sharded_weights(accelerator):
        raise ConfigError("train.optimizer=muon under FSDP or DeepSpeed ZeRO-3: Muon orthogonalises whole matrices, "
                          "which these backends shard; use train.optimizer=adamw or multi_gpu.yaml")

    # FSDP: the verifier's decoder layers sharded over the processes (train.placement.shard_verifier); otherwise whole.
    verifier, tokenizer = load_verifier(cfg, accelerator.device, accelerator)
    train_dl, eval_dl = get_dataloaders(cfg, tokenizer)
    start_tracking(accelerator, cfg)  # wandb only now: the verifier, its tokenizer and the data passed their checks
    say(f"[data] {len(train_dl.dataset)} training rows, {len(eval_dl.dataset)} held-out rows of "
        f"{cfg.data.seq_len} tokens ({cfg.data.source})")

    # EAGLE-3's draft vocabulary: the most frequent *target* tokens of the training data (d2t/t2d go in the export).
    token_counts, coverage = None, None
    if cfg.eagle.version == 3:
        token_counts = draft_vocab_counts(train_dl.dataset, verifier.vocab_size)
    drafter = build_drafter(verifier, cfg.eagle, token_counts=token_counts)
    if token_counts is not None:
        coverage = float(token_counts[drafter.t2d.cpu()].sum() / token_counts.sum().clamp(min=1))
        say(f"[eagle3] draft vocabulary {drafter.draft_vocab_size} of {verifier.vocab_size} tokens covers "
            f"{coverage:.1%} of the training targets")
    if hold_draft_rows(cfg, drafter, verifier):
        say(f"[eagle3] verifier lm_head: the draft vocabulary's {drafter.draft_vocab_size} rows held, the rest "
            "freed (the feature cache stores the verifier's argmax)")
    # the nulls as this version fills them (feature layers, mask token, noise; biases and sizes through the weights'
    # shapes): a continued run must agree (train/run_folder.py, record_resolved)
    record_run_resolved(accelerator, cfg, "eagle", {
        "feature_layers": drafter.feature_layers, "mask_token_id": getattr(drafter, "mask_token_id", None),
        "input_noise": cfg.eagle.input_noise, "draft_vocab_size": getattr(drafter, "draft_vocab_size", None),
        "shapes": {name: list(t.shape) for name, t in drafter.state_dict().items()}})
    n_params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    say(f"[eagle{cfg.eagle.version}] {n_params / 1e6:.2f}M trainable parameters; verifier features: layers "
        f"{drafter.feature_layers or 'final'} ({cfg.features})")

    model = EagleTrainModule(drafter)
    optimizer = build_optimizer(model, cfg)
    scheduler = cosine_schedule(optimizer, cfg)
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    if (engine := engine_line(model)) is not None:  # DeepSpeed: which engine trains, stated
        accelerator.print(engine)
    accelerator.register_for_checkpointing(scheduler)
    features = feature_source(cfg, verifier, layer_ids=drafter.feature_layers)

    # ---- held-out evaluation: counts summed over batches and processes, turned into rates once ----
    drafter_parts = ("feature_loss", "token_loss") if cfg.eagle.version == 1 else ()

    def measure(batch: dict) -> dict[str, torch.Tensor]:
        feats = features(batch)
        positions = batch.get("position_ids")  # packed rows: restarting per document
        out = model(batch["input_ids"], feats, batch["loss_mask"], positions)
        c = out.counts
        if cfg.eagle.version == 1:  # trained on one step; scored on the eagle.ttt_steps-token chains it drafts
            c = model(batch["input_ids"], feats, batch["loss_mask"], positions, chain_steps=cfg.eagle.ttt_steps)
        return {**chain_sums(out, c), **out.parts}

    def evaluate() -> dict[str, float]:
        sums = heldout_sums(accelerator, model, eval_dl, cfg.train.eval_batches, measure)
        if not sums:
            return {}
        values, acc = chain_eval_values(accelerator, sums, loop.state.step, "step", first=0)
        batches = sums["batches"]
        if len(sums["step_losses"]) > 1:
            values.update({f"eval/step_loss_{k}": v for k, v in enumerate((sums["step_losses"] / batches).tolist())})
        values.update({f"eval/{key}": float(sums[key] / batches) for key in drafter_parts})
        loop.print(f"[eval] step {loop.state.step}: held-out accuracy per draft step {' '.join(f'{a:.3f}' for a in acc)} "
            f"(step 0: {acc[0]:.3f}), simulated acceptance length {values['eval/accept_length']:.3f}")
        return values

    # ---- the loop ----
    loop = TrainLoop(accelerator, cfg, model, optimizer, scheduler, train_dl, evaluate=evaluate)
    loop.resume()
    for batch in loop.batches():
        feats = features(batch)  # frozen verifier, no grad: outside the autocast/accumulate block on purpose
        with accelerator.accumulate(model):
            out = model(batch["input_ids"], feats, batch["loss_mask"], batch.get("position_ids"))
            accelerator.backward(out.loss)
            loop.step(out.loss, step_metrics(out), tokens=batch_tokens(batch))
    loop.finish()
    loop.final_evaluation()  # unless the last step ran one

    # ---- export ----
    summary = {**loop.summary(), "data": cfg.data.source, "seq_len": cfg.data.seq_len}
    if coverage is not None:
        summary["draft_vocab_coverage"] = coverage
    # Whole weights (gathered when FSDP / ZeRO-3 sharded them); a fresh copy then, built like the trained one.
    drafter = export_drafter(accelerator, model, cfg.export_dtype,
                             lambda: EagleTrainModule(build_drafter(verifier, cfg.eagle, token_counts)))
    if accelerator.is_main_process:
        folder = export_eagle(drafter, cfg.drafter_dir, verifier, training=summary, engine=cfg.engine,
                              num_speculative_tokens=cfg.num_speculative_tokens)
        say(f"[export] {folder} ({cfg.engine}, {cfg.export_dtype})")
    # Train/serve consistency: the export, reloaded from disk, must accept what the in-memory drafter accepts.
    return finish_run(accelerator, loop, summary, cfg, drafter, verifier, eval_dl.dataset, tokenizer, say=say)


if __name__ == "__main__":
    main_guard(main, EagleRunConfig)
