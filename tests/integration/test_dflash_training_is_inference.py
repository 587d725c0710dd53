"""What DFlash training scores is what the engine does: on a row that is the verifier's own greedy continuation,
every anchored block of `training_loss` (its anchor, the context strictly before it, targets anchor + k, the
per-position counts) drafts exactly the tokens the engine drafts when it decodes from the row cut at that anchor
(first token from the prefill: the anchor is the verifier's own next token, the context everything before it), and
the accepted length the training counts imply equals the engine's accepted count at that step."""

from __future__ import annotations

import pytest
import torch

from draftheads.eval import SpeculativeDecoder
from draftheads.eval.drafters import make_drafter
from draftheads.models.dflash import DFlashConfig, build_drafter
from draftheads.models.verifier import Verifier
from tests.utils import greedy_corpus, peaked_model, train_eagle_briefly

pytestmark = pytest.mark.usefixtures("one_thread")

N = 5  # block size


@pytest.mark.parametrize("settings", [{"loss": "ce"}, {"loss": "kl"},
                                      {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3},
                                      {"draft_vocab_size": 64}])
def test_training_blocks_draft_and_accept_as_the_engine(settings):
    model = peaked_model("qwen3")
    verifier = Verifier(model)
    prompts = [[5, 77, 31, 200, 9], [42, 9, 8, 8], [3, 40, 9, 100, 7, 64]]
    corpus = greedy_corpus(model, prompts, 24)
    torch.manual_seed(0)
    layers = len(settings.get("layer_types", [None]))
    counts = torch.bincount(torch.tensor([t for row in corpus for t in row]), minlength=verifier.vocab_size)
    drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=layers, block_size=N, target_layer_ids=[0, 2],
                                                   mask_token_id=0, num_anchors=16, **settings), token_counts=counts)
    drafter = train_eagle_briefly(drafter, verifier, corpus, steps=15, lr=1e-2)

    row = corpus[0]
    T = len(row)
    ids = torch.tensor([row])
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, len(prompts[0]):] = 1
    feats = verifier.features(ids, layer_ids=drafter.feature_layers, return_logits=True)
    anchor_list = list(range(len(prompts[0]), T - N))
    anchors = torch.tensor([anchor_list])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        hidden = drafter.anchored_hidden(ids, torch.cat(feats.layers, -1), anchors, valid)[:, :, 1:]
        train_logits = drafter.logits(hidden)[0]  # (A, N-1, V)
        train_drafts = train_logits.argmax(-1).tolist()
        train_accepted = []
        for a in anchor_list:  # one anchor at a time: its chain count is its accepted length
            out = drafter.training_loss(ids, feats, loss_mask, anchors=(torch.tensor([[a]]), valid[:, :1]))
            train_accepted.append(int(out.counts.chain_correct.sum()))

    dflash = make_drafter("dflash", verifier, drafter)
    first = {}
    propose, logits = dflash.propose, dflash.model.logits
    seen = []

    def recording_logits(hidden):  # what propose turns into draft tokens
        seen.append(logits(hidden))
        return seen[-1]

    def recording(state, sampling):
        draft = propose(state, sampling)
        for b in range(state.batch_size):
            first.setdefault(b, (draft.tokens[b].tolist(), seen[-1][b]))
        return draft

    dflash.propose, dflash.model.logits = recording, recording_logits
    dec = SpeculativeDecoder(verifier, dflash, "dflash", first_token="prefill")
    out = dec.generate([row[:a] for a in anchor_list], N + 1, eos_token_id=None)
    engine_accepted = [steps[0] for steps in out.stats.accepted]
    assert [first[b][0] for b in range(len(anchor_list))] == train_drafts
    assert engine_accepted == train_accepted
    # the logits too, not only their argmax
    engine_logits = torch.stack([first[b][1] for b in range(len(anchor_list))])  # (A, N-1, V)
    assert torch.allclose(engine_logits, train_logits, atol=1e-4)
    assert 0 < sum(train_accepted) < len(anchor_list) * (N - 1), "drafts should be accepted and rejected for real"
