"""Train Medusa heads on a frozen verifier (Medusa-1), or heads and LoRA adapters on the verifier jointly (Medusa-2).

    accelerate launch train/medusa.py --config configs/medusa-tiny.yaml
    accelerate launch train/medusa.py --config configs/medusa-tiny.yaml --train.max_steps=50 --medusa.num_heads=3
    accelerate launch train/medusa.py --config configs/medusa2-tiny.yaml        # Medusa-2 (medusa.joint: true)

(`python train/medusa.py ...` is the same run in one process.)

Each step runs the verifier on a batch under no-grad (its final post-norm hidden state h_t is what the heads read),
then head k's logits at t are scored against token t+k+2: cross-entropy with the data (`medusa.loss: labels`) or KL
to the verifier's own distribution of that token (`distill`), weighted decay^k, masked by the batch's loss mask.
Medusa-2 instead runs the verifier with its adapters and gradients, and adds its own next-token loss plus a KL to
the original verifier (adapters off) that keeps it faithful. Losses are computed head by head in (C, V) chunks
(models/linear_loss.py), so no (K, B, T, V) logits or gradients ever exist: peak memory is the verifier's
activations plus a few chunks, whatever the vocabulary.

Held-out evaluation every `train.eval_every` steps and at the end logs eval/head{k}_loss, _top1, _top5 and a
per-head table. At the end the per-rank accuracies of each head on the held-out data build the static tree
(`medusa.tree_budget` nodes) and everything is exported to `{output_dir}/drafter/` (the folder vLLM's Medusa loader
reads; Medusa-2 adds `adapter/`), reloaded from there and checked: it must decode held-out prompts through our
engine exactly as the in-memory heads do (`consistency` section; eval/tau is the export's tau, a difference
exits non-zero, train/finish.py). The run folder also holds config.yaml, metrics.jsonl, step-NNNNNN/ checkpoints
(`--train.resume=auto` continues from the newest) and wandb/ (offline unless an API key is configured).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from draftheads.models.export import save_medusa
from draftheads.models.medusa import (
    MedusaConfig,
    MedusaHeads,
    MedusaJoint,
    add_lora_from_config,
    build_medusa_tree,
    expected_accepted_length,
    medusa2_losses,
    medusa_head_losses,
)
from draftheads.models.verifier import Verifier, VerifierFeatures
from draftheads.train.cli import main_guard
from draftheads.train.config import ConfigError, RunConfig
from draftheads.train.finish import finish_run
from draftheads.train.features import FeatureSource, feature_source, online_features
from draftheads.train.heldout import heldout_sums
from draftheads.train.loaders import get_dataloaders
from draftheads.train.loop import TrainLoop
from draftheads.train.optim import build_optimizer, cosine_schedule
from draftheads.train.placement import load_verifier, sharded_weights, unsharded
from draftheads.train.tracking import build_accelerator, log_table, start_tracking
from draftheads.train.zero import engine_line


@dataclass
class MedusaRunConfig(RunConfig):
    """A Medusa training run: verifier, data, loop, logging, and the `medusa` section."""

    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    """Heads, loss, Medusa-2 joint training and the exported tree."""

    def __post_init__(self):
        super().__post_init__()
        if self.features == "offline" and self.medusa.joint:
            raise ConfigError("features=offline with medusa.joint=true: Medusa-2 trains through the verifier itself, "
                              "so it cannot read cached features; use features=online")
        heads, seq_len = self.medusa.num_heads, self.data.seq_len
        if heads > seq_len - 2:  # head k at position t predicts token t+k+2 of the row
            raise ConfigError(f"medusa.num_heads={heads} with data.seq_len={seq_len}: head k predicts token t+k+2, so "
                              f"heads past {seq_len - 2} would never see a target; set medusa.num_heads <= "
                              f"{seq_len - 2} or raise data.seq_len")


# ---- what accelerator.prepare wraps: the trainable part, with the loss in forward (DDP syncs through forward) ----
class HeadsObjective(nn.Module):
    """Medusa-1: the heads; forward takes the frozen verifier's features of a batch."""

    def __init__(self, heads: MedusaHeads, cfg: MedusaConfig):
        super().__init__()
        self.heads, self.cfg = heads, cfg

    def forward(self, feats: VerifierFeatures, batch: dict, max_rank: int = 1):
        head = medusa_head_losses(self.heads, feats.final, batch["input_ids"], batch["loss_mask"], self.cfg.loss,
                                  feats.logits, self.cfg.decay, max_rank, position_ids=batch.get("position_ids"))
        return head.loss, {}, head


class JointObjective(nn.Module):
    """Medusa-2: the verifier with LoRA adapters and the heads; forward runs the verifier itself, with grad."""

    def __init__(self, joint: MedusaJoint, cfg: MedusaConfig):
        super().__init__()
        self.joint, self.cfg = joint, cfg
        # Checkpoints hold what trains (adapters, heads), not the frozen verifier: it reloads from its own folder,
        # and its weights are reachable under two names (`verifier.model...` and `verifier.decoder...`).
        self._trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        self.register_state_dict_post_hook(JointObjective._keep_trainable)

    @staticmethod
    def _keep_trainable(module, state_dict, prefix, local_metadata):
        for key in [k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in module._trainable]:
            del state_dict[key]

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        expected = set(self.state_dict())
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(f"Medusa-2 checkpoint does not match: missing {missing[:5]}, unexpected "
                               f"{unexpected[:5]}")
        super().load_state_dict(state_dict, strict=False, assign=assign)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    @property
    def heads(self) -> MedusaHeads:
        return self.joint.heads

    def forward(self, feats: None, batch: dict, max_rank: int = 1):
        verifier, cfg = self.joint.verifier, self.cfg
        ids, attention_mask, positions = batch["input_ids"], batch["attention_mask"], batch.get("position_ids")
        if positions is not None:  # packed documents: the restarts mask attention (as Verifier.features)
            attention_mask = None
        reference = self.joint.reference_logits(ids, attention_mask, positions)  # (B, T, V), adapters off, no grad
        hidden = verifier.decoder(input_ids=ids, attention_mask=attention_mask, position_ids=positions,
                                  use_cache=False).last_hidden_state  # (B, T, H), through the adapters
        loss, parts, head = medusa2_losses(hidden, verifier.lm_head.weight, reference, self.joint.heads, ids,
                                           batch["loss_mask"], cfg.loss, cfg.decay, cfg.lm_loss_weight,
                                           cfg.kl_loss_weight, cfg.heads_loss_weight, max_rank=max_rank,
                                           position_ids=positions)
        return loss, parts, head


def batch_features(features: Verifier | FeatureSource, batch: dict, cfg: MedusaRunConfig) -> VerifierFeatures | None:
    """What the heads read for one batch: the frozen verifier's final hidden state (and logits for `distill`).

    `features` is the run's source (`train.features.feature_source`: online, or the offline cache) or a verifier
    (run online). Medusa-2 returns None: its objective runs the adapted verifier itself.
    """
    if cfg.medusa.joint:
        return None
    if isinstance(features, Verifier):
        features = online_features(features, return_logits=cfg.medusa.loss == "distill")
    return features(batch)  # no-grad inside


# ---- held-out evaluation ---------------------------------------------------------------------------------------
@dataclass
class HeldOut:
    """Per-head held-out results, summed over batches and processes."""

    loss: torch.Tensor
    """(K,) mean loss of each head."""
    hits: torch.Tensor
    """(K, R) positions where the target was head k's rank-r prediction."""
    counts: torch.Tensor
    """(K,) positions scored."""
    parts: dict[str, torch.Tensor]
    """Medusa-2: mean `lm` and `kl` of the verifier itself."""

    def topk(self, k: int) -> torch.Tensor:
        return self.hits[:, :k].sum(-1) / self.counts.clamp(min=1)  # (K,)

    def rank_accuracy(self) -> torch.Tensor:
        return self.hits / self.counts.clamp(min=1)[:, None]  # (K, R)


def evaluate(accelerator, model, features, eval_dl, cfg: MedusaRunConfig, max_batches: int = 0,
             max_rank: int = 5) -> HeldOut | None:
    """Run the held-out batches (all of them when max_batches is 0) through `train.heldout.heldout_sums`; None when
    there are none."""

    def measure(batch: dict) -> dict[str, torch.Tensor]:
        _, parts, head = model(batch_features(features, batch, cfg), batch, max_rank=max_rank)
        # per_head is a mean over this batch's positions: times the counts, it sums over batches
        return {"loss_sum": head.per_head * head.counts, "counts": head.counts, "hits": head.hits,
                **{f"part/{k}": v for k, v in parts.items()}}

    sums = heldout_sums(accelerator, model, eval_dl, max_batches, measure)
    if not sums:
        return None
    batches, counts = sums["batches"], sums["counts"]
    parts = {k.removeprefix("part/"): v / batches for k, v in sums.items() if k.startswith("part/")}
    return HeldOut(loss=sums["loss_sum"] / counts.clamp(min=1), hits=sums["hits"], counts=counts, parts=parts)


def eval_metrics(result: HeldOut, decay: float) -> dict[str, float]:
    top1, top5 = result.topk(1).tolist(), result.topk(5).tolist()
    losses = result.loss.tolist()
    metrics = {"eval/loss": sum(decay ** k * loss for k, loss in enumerate(losses))}
    for k, (loss, t1, t5) in enumerate(zip(losses, top1, top5)):
        metrics.update({f"eval/head{k}_loss": loss, f"eval/head{k}_top1": t1, f"eval/head{k}_top5": t5})
    metrics.update({f"eval/{key}": value.item() for key, value in result.parts.items()})
    return metrics


def log_head_table(accelerator, result: HeldOut, step: int) -> list[list]:
    rows = [[k, f"t+{k + 2}", round(loss, 4), round(t1, 4), round(t5, 4)]
            for k, (loss, t1, t5) in enumerate(zip(result.loss.tolist(), result.topk(1).tolist(),
                                                   result.topk(5).tolist()))]
    log_table(accelerator, "eval/head_accuracy", ["head", "predicts", "loss", "top1", "top5"], rows, step=step)
    return rows


# ---- the run ---------------------------------------------------------------------------------------------------
def main(cfg: MedusaRunConfig) -> dict:
    started = time.perf_counter()
    accelerator = build_accelerator(cfg)  # mixed precision, grad accumulation; claims the run folder (lock, record)
    if cfg.train.optimizer == "muon" and sharded_weights(accelerator):
        raise ConfigError("train.optimizer=muon under FSDP or DeepSpeed ZeRO-3: Muon orthogonalises whole matrices, "
                          "which these backends shard; use train.optimizer=adamw or multi_gpu.yaml")
    if cfg.medusa.joint and sharded_weights(accelerator):
        raise ConfigError("medusa.joint=true (Medusa-2) under FSDP or DeepSpeed ZeRO-3 is not supported: the LoRA "
                          "adapters live in the verifier, which these backends would shard; use multi_gpu.yaml or "
                          "deepspeed_zero2.yaml")
    # Frozen, eval mode; under FSDP its decoder layers sharded over the processes (train.placement.shard_verifier).
    verifier, tokenizer = load_verifier(cfg, accelerator.device, accelerator)
    train_dl, eval_dl = get_dataloaders(cfg, tokenizer)
    start_tracking(accelerator, cfg)  # wandb only now: the verifier, its tokenizer and the data passed their checks

    # Heads in fp32 (the master weights; autocast runs their matmuls in bf16 under mixed precision), each a copy of
    # the verifier's lm_head behind identity ResBlocks.
    heads = MedusaHeads.from_config(cfg.medusa, verifier)
    if cfg.medusa.joint:
        add_lora_from_config(verifier, cfg.medusa)  # verifier.model becomes the peft model; only adapters train
        joint = MedusaJoint(verifier, heads)
        model = JointObjective(joint, cfg.medusa)
        optimizer = build_optimizer(joint.param_groups(cfg.train.lr, cfg.medusa.head_lr_multiplier,
                                                       cfg.train.weight_decay), cfg)
    else:
        model = HeadsObjective(heads, cfg.medusa)
        optimizer = build_optimizer(heads, cfg)
    scheduler = cosine_schedule(optimizer, cfg)  # warm-up, then cosine to lr x min_lr_ratio, per param group

    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    if (engine := engine_line(model)) is not None:  # DeepSpeed: which engine trains, stated
        accelerator.print(engine)
    accelerator.register_for_checkpointing(scheduler)
    trainable = [p for p in model.parameters() if p.requires_grad]
    max_rank = max(5, cfg.medusa.tree_max_rank)
    if cfg.medusa.joint and cfg.data.pack and cfg.data.document_mask:
        verifier.check_document_mask()  # Medusa-2 runs the verifier itself on the packed rows
    features = verifier if cfg.medusa.joint else feature_source(cfg, verifier,
                                                                return_logits=cfg.medusa.loss == "distill")

    def periodic_eval() -> dict[str, float]:
        result = evaluate(accelerator, model, features, eval_dl, cfg, cfg.train.eval_batches)
        if result is None:
            return {}
        log_head_table(accelerator, result, loop.state.step)
        return eval_metrics(result, cfg.medusa.decay)

    loop = TrainLoop(accelerator, cfg, model, optimizer, scheduler, train_dl, evaluate=periodic_eval,
                     clip_params=trainable)
    loop.resume()
    model.train()  # Medusa-2: LoRA dropout on; the frozen verifier of Medusa-1 stays in eval mode
    for batch in loop.batches():
        with accelerator.accumulate(model):
            feats = batch_features(features, batch, cfg)  # (B, T, H) under no-grad: online or cached
            loss, parts, head = model(feats, batch)
            accelerator.backward(loss)
            metrics = {**parts, **{f"head{k}_loss": head.per_head[k] for k in range(cfg.medusa.num_heads)},
                       **{f"head{k}_top1": head.hits[k, 0] / head.counts[k].clamp(min=1)
                          for k in range(cfg.medusa.num_heads)}}
            loop.step(loss, metrics, tokens=batch["attention_mask"].sum())
    loop.finish()

    # Final held-out pass over all of it: per-head accuracy, the rank accuracies the tree is built from.
    result = evaluate(accelerator, model, features, eval_dl, cfg, max_batches=0, max_rank=max_rank)
    summary = {**loop.summary(), "data": cfg.data.source, "seq_len": cfg.data.seq_len,
               "tokens": loop.state.step * cfg.train.grad_accum * cfg.train.batch_size * cfg.data.seq_len
               * accelerator.num_processes, "joint": cfg.medusa.joint, "loss": cfg.medusa.loss,
               "final_train": {k.removeprefix("train/"): v for k, v in _last_train_log(loop).items()}}
    tree = rank_accuracy = None
    if result is None:
        accelerator.print("[medusa] no held-out data (data.eval_rows=0): exported without accuracies or tree")
    else:
        metrics = eval_metrics(result, cfg.medusa.decay)
        loop.log(metrics)
        rows = log_head_table(accelerator, result, loop.state.step)
        rank_accuracy = result.rank_accuracy()[:, :cfg.medusa.tree_max_rank]  # (K, R)
        tree = build_medusa_tree(rank_accuracy, cfg.medusa.tree_budget)
        summary["eval"] = {k.removeprefix("eval/"): v for k, v in metrics.items()}
        summary["tree_expected_accepted_length"] = expected_accepted_length(tree, rank_accuracy)
        _print_report(accelerator, rows, verifier.vocab_size, len(tree), summary["tree_expected_accepted_length"])
    summary["wall_time_s"] = round(time.perf_counter() - started, 1)  # from the start: loading and data included

    # Whole weights (gathered when FSDP / ZeRO-3 sharded them); a fresh copy then, built like the trained one.
    full = unsharded(accelerator, model, lambda: HeadsObjective(MedusaHeads.from_config(cfg.medusa, verifier),
                                                                cfg.medusa))
    heads = full.heads if full is not None else None
    if accelerator.is_main_process:
        save_medusa(cfg.drafter_dir, heads, verifier, tree=tree, training_summary=summary,
                    rank_accuracy=rank_accuracy)
        accelerator.print(f"[medusa] drafter exported to {cfg.drafter_dir} ({summary['wall_time_s']} s)")
    # Train/serve consistency: the export, reloaded, must draft the same tree and accept the same tokens.
    return finish_run(accelerator, loop, summary, cfg, heads, verifier, eval_dl.dataset, tokenizer,
                      say=accelerator.print, tree=tree)


def _last_train_log(loop: TrainLoop) -> dict:
    for record in reversed(loop.history):
        if "train/loss" in record:
            return {k: v for k, v in record.items() if k.startswith("train/")}
    return {}


def _print_report(accelerator, rows: list[list], vocab_size: int, nodes: int, accepted: float) -> None:
    accelerator.print(f"[medusa] head-0 held-out top-1 = {rows[0][3]:.4f} (chance 1/V = {1 / vocab_size:.6f})")
    accelerator.print("[medusa] head  predicts  loss     top1    top5")
    for k, predicts, loss, top1, top5 in rows:
        accelerator.print(f"[medusa] {k:>4}  {predicts:<8}  {loss:<7.4f}  {top1:.4f}  {top5:.4f}")
    accelerator.print(f"[medusa] static tree: {nodes} nodes, expected accepted length {accepted:.3f} "
                      f"(tau = {1 + accepted:.3f} with the bonus token)")


if __name__ == "__main__":
    main_guard(main, MedusaRunConfig)
