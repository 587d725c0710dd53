"""scripts/step0_accuracy.py scores the same quantities the trainers log, on the same positions."""

import pytest
import torch

from draftheads.models.eagle import EagleConfig, build_drafter
from draftheads.models.medusa import MedusaHeads
from draftheads.models.verifier import Verifier
from tests.medusa_reference import head_accuracy
from tests.utils import script_module


def test_step0_accuracy_matches_the_trainers_metrics(llama_dir):
    script = script_module("step0_accuracy")
    verifier = Verifier.from_pretrained(llama_dir)
    torch.manual_seed(0)
    V = verifier.vocab_size
    eagle1 = build_drafter(verifier, EagleConfig(version=1)).eval()
    eagle3 = build_drafter(verifier, EagleConfig(version=3, draft_vocab_size=128, ttt_steps=2),
                           token_counts=torch.randint(0, 50, (V,))).eval()
    heads = MedusaHeads.from_verifier(verifier, num_heads=2).eval()
    with torch.no_grad():  # heads away from the verifier's own lm_head, so head 0 is not a copy of it
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        ids = torch.randint(3, V, (2, 16), generator=g)
        loss_mask = (torch.rand(2, 16, generator=g) > 0.3).long()
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask})
    results = script.step0_accuracy({"e1": eagle1, "e3": eagle3, "medusa": heads}, verifier, batches)

    expected_positions = sum(int(b["loss_mask"][:, 2:].sum()) for b in batches)
    assert all(r["positions"] == expected_positions for r in results.values())
    for name, drafter in (("e1", eagle1), ("e3", eagle3)):  # EAGLE: the trainer's eval/acc_0, summed over batches
        counts = None
        for b in batches:
            feats = verifier.features(b["input_ids"], layer_ids=drafter.feature_layers)
            c = drafter.training_loss(b["input_ids"], feats, b["loss_mask"]).counts
            counts = c if counts is None else counts + c
        assert (results[name]["verifier"] * expected_positions, expected_positions) == pytest.approx(
            (float(counts.correct[0]), float(counts.valid[0])))
    hits = total = 0  # Medusa: the trainer's eval/head0_top1, against the data token
    for b in batches:
        feats = verifier.features(b["input_ids"])
        acc = head_accuracy(heads(feats.final), b["input_ids"], b["loss_mask"], ks=(1,))[0, 0]
        n = int(b["loss_mask"][:, 2:].sum())
        hits, total = hits + float(acc) * n, total + n
    assert abs(results["medusa"]["data"] - hits / total) < 1e-6
    assert max(r["verifier"] + r["data"] for r in results.values()) > 0  # not all trivially zero
