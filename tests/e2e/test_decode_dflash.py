"""The `dflash` method end to end: a DFlash export loaded by the engine drafts a block per step (one drafter forward),
verified as a chain. Greedy decoding equals Hugging Face's on Llama, Qwen2 and Qwen3 verifiers, batch 1 and a ragged
batch, with the first token from the first step or from the prefill; every step's drafts equal what the reference
computation (the drafter's z-lab `forward` over the whole committed context, no cache) drafts from the same state, so
the context cache grows by exactly what was accepted; the fused loop decodes the same. The drafters are trained
briefly on their verifier's own continuations, so drafts are accepted and rejected for real."""

from __future__ import annotations

import functools

import pytest
import torch

from draftheads.eval import SpeculativeDecoder
from draftheads.eval.drafters import make_drafter
from draftheads.models.dflash import DFlashConfig, build_drafter
from draftheads.models.export import export_dflash
from draftheads.models.verifier import Verifier
from tests.utils import greedy_corpus, hf_greedy, peaked_model, train_eagle_briefly

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("llama", "qwen2", "qwen3")
PROMPTS = [[5, 77, 31, 200, 9, 77, 31], [42, 9], [8, 8, 120, 3, 64, 19, 250, 7, 120, 3]]
FIT = PROMPTS + [[3 + i, 40 + 7 * i, 9, 100 + i] for i in range(3)]
MAX_NEW = 24


def briefly_trained(verifier, corpus, steps: int = 12, **cfg):
    """A DFlash drafter trained a few Adam steps on `corpus` (right part of the time), eval mode."""
    torch.manual_seed(0)
    cfg = {"num_hidden_layers": 1, "block_size": 4, "target_layer_ids": [0, 2], "mask_token_id": 0,
           "num_anchors": 32, **cfg}
    return train_eagle_briefly(build_drafter(verifier, DFlashConfig(**cfg)), verifier, corpus, steps=steps, lr=1e-2)


@functools.cache
def setup(family: str):
    model = peaked_model(family)
    verifier = Verifier(model)
    drafter = briefly_trained(verifier, greedy_corpus(model, FIT, MAX_NEW))
    return model, verifier, drafter


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per family: the verifier, its drafter's export folder and HF greedy decoding of PROMPTS (made once)."""
    out = {}
    for family in FAMILIES:
        model, verifier, drafter = setup(family)
        refs = {tuple(p): hf_greedy(model, p, MAX_NEW) for p in PROMPTS}
        out[family] = (verifier, export_dflash(drafter, tmp_path_factory.mktemp(family), verifier), refs)
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("first_token", ["draft", "prefill"])
def test_greedy_equals_hf_generate(exported, family, first_token):
    verifier, folder, want = exported[family]
    dec = SpeculativeDecoder(verifier, make_drafter("dflash", verifier, str(folder)), "dflash",
                             first_token=first_token)
    assert dec.drafter.num_draft_tokens == 3  # block_size - 1
    for batch in (PROMPTS[:1], PROMPTS):
        out = dec.generate(batch, MAX_NEW, eos_token_id=None)
        assert out.output_ids == [want[tuple(p)] for p in batch]
    accepted = [a for row in out.stats.accepted for a in row]
    assert sum(accepted) >= 5 and accepted.count(0) >= 3, "drafts should be accepted and rejected for real"


class Recording:
    """Wraps a drafter's propose: keeps, per step, the committed tokens and the drafts of every row."""

    def __init__(self, drafter):
        self.drafter, self.steps = drafter, []
        self.propose = drafter.propose
        drafter.propose = self

    def __call__(self, state, sampling):
        draft = self.propose(state, sampling)
        self.steps.append([(state.tokens[b, : state.lengths_host[b] + 1].tolist(), draft.tokens[b].tolist())
                           for b in range(state.batch_size) if state.active_host[b]])
        return draft


@pytest.mark.parametrize("num_draft_tokens", [None, 2])
def test_every_step_drafts_what_a_fresh_forward_drafts(num_draft_tokens):
    """After accepted and rejected drafts, the engine's drafts equal those of the drafter's own forward over the
    whole committed context (no cache): the cache held exactly the committed tokens' context."""
    model, verifier, drafter = setup("qwen3")
    dflash = make_drafter("dflash", verifier, drafter, num_draft_tokens=num_draft_tokens)
    rec = Recording(dflash)
    out = SpeculativeDecoder(verifier, dflash, "dflash").generate(PROMPTS, MAX_NEW, eos_token_id=None)
    K = dflash.num_draft_tokens
    assert sum(map(sum, out.stats.accepted)) > 0
    checked = 0
    for step in rec.steps:
        for row, drafts in step:
            context, root = row[:-1], row[-1]
            if not context:
                continue
            ids = torch.tensor([context])
            feats = verifier.features(ids, layer_ids=drafter.feature_layers)
            block = torch.tensor([[root] + [drafter.mask_token_id] * K])
            with torch.no_grad():
                hidden = drafter(torch.arange(len(context) + K + 1)[None], noise_embedding=drafter.embed(block),
                                 target_hidden=torch.cat(feats.layers, -1))
                want = drafter.logits(hidden[:, 1:]).argmax(-1)[0].tolist()
            assert drafts == want
            checked += 1
    assert checked > 20


def test_fused_loop_decodes_the_same():
    from draftheads.eval.engine.cuda_loop import Buckets, FusedDecoder

    model, verifier, drafter = setup("llama")
    dec = SpeculativeDecoder(verifier, make_drafter("dflash", verifier, drafter), "dflash")
    # greedy with the batch padded to a bucket (an inactive row); sampled unpadded, so the draws are the same
    for batch, temperature in (((1, 4), 0.0), (None, 1.0)):
        fused = FusedDecoder(dec, graphs=False, buckets=Buckets(batch=batch, capacity=64, window=64))
        a = dec.generate(PROMPTS, MAX_NEW, temperature=temperature, seed=3, eos_token_id=None)
        b = fused.generate(PROMPTS, MAX_NEW, temperature=temperature, seed=3, eos_token_id=None)
        assert a.output_ids == b.output_ids and a.stats.accepted == b.stats.accepted


def test_option_and_draft_errors(exported):
    verifier, folder, _ = exported["llama"]
    with pytest.raises(ValueError, match="num_draft_tokens=0"):
        make_drafter("dflash", verifier, str(folder), num_draft_tokens=0)
    with pytest.raises(ValueError, match="has no option"):
        make_drafter("dflash", verifier, str(folder), chain=3)
    with pytest.raises(ValueError, match="needs draft"):
        make_drafter("dflash", verifier)
    other, _, _ = exported["qwen2"]
    with pytest.raises(Exception, match="verifier"):
        make_drafter("dflash", other, str(folder))


def test_dspark_drafts_left_to_right_and_decodes_as_hf():
    """A DSpark drafter (a Markov head, trained with the backbone) through its export: greedy decoding equals HF's
    on a ragged batch, and every step's drafts are the slow reference's chain (tests/dspark_reference.py: the whole
    transition table) over a fresh forward of the whole committed context."""
    from tests.dspark_reference import slow_markov_chain

    model, verifier, _ = setup("qwen3")
    drafter = briefly_trained(verifier, greedy_corpus(model, FIT, MAX_NEW), markov_rank=16)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        dspark = make_drafter("dflash", verifier, str(export_dflash(drafter, tmp, verifier)))
    rec = Recording(dspark)
    out = SpeculativeDecoder(verifier, dspark, "dflash").generate(PROMPTS, MAX_NEW, eos_token_id=None)
    assert out.output_ids == [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    accepted = [a for row in out.stats.accepted for a in row]
    assert sum(accepted) >= 5 and accepted.count(0) >= 3, "drafts should be accepted and rejected for real"
    K, checked, biased = dspark.num_draft_tokens, 0, 0
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    for step in rec.steps:
        for row, drafts in step:
            context, root = row[:-1], row[-1]
            if not context:
                continue
            feats = verifier.features(torch.tensor([context]), layer_ids=drafter.feature_layers)
            block = torch.tensor([[root] + [drafter.mask_token_id] * K])
            with torch.no_grad():
                hidden = drafter(torch.arange(len(context) + K + 1)[None], noise_embedding=drafter.embed(block),
                                 target_hidden=torch.cat(feats.layers, -1))
                base = drafter.logits(hidden[0, 1:])
                assert drafts == slow_markov_chain(base, root, w1, w2)
            biased += drafts != base.argmax(-1).tolist()
            checked += 1
    assert checked > 20 and biased >= 3, (checked, biased)  # the Markov bias changed drafts: the check can fail
