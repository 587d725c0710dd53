"""Packed rows without attention across a document boundary, against the reference: each document computed alone.

The verifier's features of a packed row (position_ids restarting per document) equal each document's features
computed alone, for tiny Llama and Qwen3 verifiers in float32; the EAGLE drafters' TTT unroll, loss and counts on a
packed row equal the per-document ones, and so do DFlash's anchored blocks; a model that would attend across is
refused in one line.
"""

import pytest
import torch

from draftheads.models.eagle import EagleConfig, build_drafter
from draftheads.models.verifier import Verifier, VerifierError
from tests.utils import tiny_model

LENGTHS = (6, 9, 5)
LAYERS = [1, 2, 3]


def packed_docs(vocab: int = 256, seed: int = 0):
    """(documents [(n,)], packed row (1, T), position_ids (1, T))."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return docs, torch.cat(docs)[None], positions


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def verifier(request):
    torch.manual_seed(0)
    return Verifier(tiny_model(request.param).float())


def test_packed_features_equal_each_document_alone(verifier):
    docs, row, positions = packed_docs()
    packed = verifier.features(row, layer_ids=LAYERS, return_logits=True, position_ids=positions)
    start = 0
    for doc in docs:
        alone = verifier.features(doc[None], layer_ids=LAYERS, return_logits=True)
        end = start + len(doc)
        torch.testing.assert_close(packed.final[:, start:end], alone.final, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.logits[:, start:end], alone.logits, rtol=1e-5, atol=1e-5)
        for a, b in zip(packed.layers, alone.layers):
            torch.testing.assert_close(a[:, start:end], b, rtol=1e-5, atol=1e-5)
        start = end
    # The reference can fail: the same row without document positions attends across (the old packing).
    across = verifier.features(row, layer_ids=LAYERS)
    assert not torch.allclose(across.final[:, LENGTHS[0]:], packed.final[:, LENGTHS[0]:], atol=1e-3)
    # A batch mixing a packed row and a plain one, right-padded as the last packed row is: each row its own.
    plain = torch.arange(row.shape[1])[None]
    both = verifier.features(torch.cat([row, row]), position_ids=torch.cat([positions, plain]))
    torch.testing.assert_close(both.final[:1], packed.final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both.final[1:], across.final, rtol=1e-5, atol=1e-5)
    verifier.check_document_mask()


@pytest.mark.parametrize("variant", ["eagle3", "parallel", "eagle1"])
def test_drafter_on_a_packed_row_equals_each_document_alone(verifier, variant):
    """Loss, per-step losses and counts of a packed row equal the per-document ones (sums over positions), and
    so do the TTT unroll's outputs wherever a chain has read only its own document's tokens."""
    cfg = EagleConfig(version=1 if variant == "eagle1" else 3, draft_vocab_size=None, ttt_steps=3,
                      layer_ids=LAYERS if variant != "eagle1" else None, parallel=variant == "parallel")
    torch.manual_seed(0)
    drafter = build_drafter(verifier, cfg).eval()  # eval: no input noise, P-EAGLE keeps every chain
    docs, row, positions = packed_docs()
    feats = verifier.features(row, layer_ids=drafter.feature_layers, return_logits=True, position_ids=positions)
    mask = torch.ones_like(row)
    with torch.no_grad():
        packed = drafter.training_loss(row, feats, mask, positions)
        chains = drafter.chain_counts(row, feats, mask, 3, positions)
        alone = []
        for doc in docs:
            f = verifier.features(doc[None], layer_ids=drafter.feature_layers, return_logits=True)
            alone.append((drafter.training_loss(doc[None], f, torch.ones_like(doc[None])),
                          drafter.chain_counts(doc[None], f, torch.ones_like(doc[None]), 3), f))
    for field in ("correct", "valid", "chain_correct", "chain_valid"):
        torch.testing.assert_close(getattr(packed.counts, field), sum(getattr(a.counts, field) for a, _, _ in alone))
        torch.testing.assert_close(getattr(chains, field), sum(getattr(c, field) for _, c, _ in alone))
    assert packed.counts.valid.sum() > 0
    # masked means: times the positions each trained (the whole vocabulary is the draft vocabulary) they add up
    n = packed.counts.valid
    summed = sum(a.step_losses * a.counts.valid for a, _, _ in alone)
    torch.testing.assert_close(packed.step_losses * n, summed, rtol=1e-5, atol=1e-5)
    if variant != "eagle1":
        with torch.no_grad():
            outs = drafter.ttt_unroll(row, drafter.project_features(feats.layers), positions)
            start = 0
            for doc, (_, _, f) in zip(docs, alone):
                ref = drafter.ttt_unroll(doc[None], drafter.project_features(f.layers))
                for k, (o, r) in enumerate(zip(outs, ref)):
                    inside = len(doc) - 1 - k  # chains that read tokens t+1 .. t+1+k of this document only
                    torch.testing.assert_close(o[:, start:start + inside], r[:, :inside], rtol=1e-5, atol=1e-5)
                start += len(doc)
    # ... and the reference can fail: without the document positions the row attends and trains across.
    with torch.no_grad():
        across = drafter.training_loss(row, verifier.features(row, layer_ids=drafter.feature_layers,
                                                              return_logits=True), mask)
    assert across.counts.valid.sum() > packed.counts.valid.sum()


def test_dflash_blocks_on_a_packed_row_equal_each_document_alone(verifier):
    """DFlash's anchored blocks in a packed row (an anchor in each document) read what the same block reads in its
    document alone: the same hidden states, and the same trained targets (none past the document's end)."""
    from draftheads.models.dflash import DFlashConfig
    from draftheads.models.dflash import build_drafter as build_dflash

    N = 4
    torch.manual_seed(0)
    drafter = build_dflash(verifier, DFlashConfig(num_hidden_layers=2, block_size=N)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    docs, row, positions = packed_docs()
    feats = verifier.features(row, layer_ids=drafter.feature_layers, position_ids=positions)
    ctx = torch.cat(feats.layers, -1)
    local = [1, 4, 3]  # an anchor per document, the last two with a block running past the document's end
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    anchors = torch.tensor([[s + a for s, a in zip(starts, local)]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    mask = torch.ones_like(row)
    from draftheads.models.dflash.blocks import block_targets
    with torch.no_grad():
        packed = drafter.anchored_hidden(row, ctx, anchors, valid, positions)  # (1, 3, N, H)
        _, trained = block_targets(row, mask, anchors, valid, N, positions)
        for j, (doc, a) in enumerate(zip(docs, local)):
            f = verifier.features(doc[None], layer_ids=drafter.feature_layers)
            alone = drafter.anchored_hidden(doc[None], torch.cat(f.layers, -1), torch.tensor([[a]]),
                                            torch.ones(1, 1, dtype=torch.bool))
            torch.testing.assert_close(packed[0, j], alone[0, 0], rtol=1e-5, atol=1e-5)
            _, trained_alone = block_targets(doc[None], torch.ones_like(doc[None]), torch.tensor([[a]]),
                                             torch.ones(1, 1, dtype=torch.bool), N)
            assert trained[0, j].tolist() == trained_alone[0, 0].tolist()
        assert not trained[0, 2].all()  # the last document ends inside its block: those positions train nothing
        # ... and the reference can fail: without the positions the blocks read the documents before theirs.
        across = drafter.anchored_hidden(row, ctx, anchors, valid)
    assert not torch.allclose(across[0, 1], packed[0, 1], atol=1e-3)


def test_joined_padding_changes_nothing_a_trainer_reads(verifier):
    """The collators join a row's right padding to its last document (`join_padding`): a row of one document then
    attends causally (the fast path). Features, logits, loss, per-step losses and counts at the real tokens equal
    those of the padding as a document of its own, for a row of one document and a row of two."""
    from draftheads.data.batching import collate
    from draftheads.data.documents import is_packed

    docs, _, _ = packed_docs()
    T = 16
    rows = []
    for pieces in ([docs[1]], [docs[0], docs[2]]):  # 9 tokens + 7 padding; 6 + 5 tokens + 5 padding
        ids = torch.cat(pieces)
        n = len(ids)
        rows.append({"input_ids": torch.cat([ids, torch.zeros(T - n, dtype=ids.dtype)]),
                     "attention_mask": (torch.arange(T) < n).long(), "loss_mask": (torch.arange(T) < n).long(),
                     "position_ids": torch.cat([torch.arange(len(p)) for p in pieces] + [torch.arange(T - n)])})
    batch = collate(rows)
    own = torch.stack([r["position_ids"] for r in rows])  # the padding as a document of its own
    assert not torch.equal(batch["position_ids"], own)
    assert not is_packed(batch["position_ids"][:1]) and is_packed(own[:1])
    real = batch["attention_mask"].bool()
    cfg = EagleConfig(version=3, draft_vocab_size=None, ttt_steps=3, layer_ids=LAYERS)
    torch.manual_seed(0)
    drafter = build_drafter(verifier, cfg).eval()
    results = []
    for positions in (batch["position_ids"], own):
        feats = verifier.features(batch["input_ids"], layer_ids=LAYERS, return_logits=True, position_ids=positions)
        with torch.no_grad():
            results.append((feats, drafter.training_loss(batch["input_ids"], feats, batch["loss_mask"], positions)))
    (joined_f, joined), (own_f, alone) = results
    torch.testing.assert_close(joined_f.final[real], own_f.final[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(joined_f.logits[real], own_f.logits[real], rtol=1e-5, atol=1e-5)
    for a, b in zip(joined_f.layers, own_f.layers):
        torch.testing.assert_close(a[real], b[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(joined.step_losses, alone.step_losses, rtol=1e-5, atol=1e-5)
    for field in ("correct", "valid", "chain_correct", "chain_valid"):
        torch.testing.assert_close(getattr(joined.counts, field), getattr(alone.counts, field))
    assert joined.counts.valid.sum() > 0


def test_a_model_that_attends_across_is_refused():
    """An attention function that ignores the mask transformers builds (a custom kernel registered through
    `AttentionInterface`) attends across the boundaries: refused in one line naming the fix."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal_only(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register("draftheads_causal_only", causal_only)
    model = tiny_model("llama").float()
    model.config._attn_implementation = "draftheads_causal_only"
    with pytest.raises(VerifierError, match=r"attends across document boundaries.*data\.document_mask=false"):
        Verifier(model).check_document_mask()
