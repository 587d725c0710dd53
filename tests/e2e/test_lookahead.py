"""Lookahead decoding (eval/drafters/lookahead.py): greedy output equals Hugging Face greedy decoding (three families, batch 1
and a ragged batch of 3, several W/N/G), the Jacobi window's outputs are exactly the verifier's prediction for each
node's guessed sequence (the combined attention mask), sampling at T=1 is lossless (chi-square), and the loops that
cannot carry the window say so."""

import functools
import warnings

import pytest
import torch

from draftheads.eval import SpeculativeDecoder
from draftheads.eval.drafters import make_drafter
from draftheads.models.verifier import Verifier
from tests.utils import FAMILIES, peaked_with_references, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 32
PROMPTS = [[5, 77, 31, 200, 9, 77, 31], [42], [8, 8, 120, 3, 64, 19, 250, 7, 120, 3, 64]]
OPTIONS = {"default": {}, "W5-N4-G3": dict(window=5, ngram_size=4, guesses=3),
           "jacobi-only": dict(window=3, ngram_size=2, context_pool=False)}


@pytest.fixture(scope="module")
def models():
    @functools.cache
    def get(family):
        model, verifier, refs = peaked_with_references(family, PROMPTS, MAX_NEW)
        return model, verifier, [refs[tuple(p)] for p in PROMPTS]

    return get


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(models, family, options):
    model, verifier, refs = models(family)
    dec = SpeculativeDecoder(verifier, make_drafter("lookahead", verifier, **OPTIONS[options]), "lookahead")
    assert dec.generate(PROMPTS[:1], MAX_NEW).output_ids == refs[:1]
    out = dec.generate(PROMPTS, MAX_NEW)
    assert out.output_ids == refs, (family, options)
    accepted = [a for row in out.stats.accepted for a in row]
    assert sum(a > 0 for a in accepted) >= 3, accepted  # the pool's n-grams are accepted for real


def test_window_outputs_are_the_verifiers_prediction_for_each_guessed_sequence(models):
    """Node (level r, column j) at position root + j + r must see exactly prefix, root, level 0's columns 1..j and its
    column's levels 1..r: its logits equal an uncached forward over that sequence."""
    model, verifier, _ = models("llama")
    drafter = make_drafter("lookahead", verifier, window=4, ngram_size=4, guesses=2)
    dec = SpeculativeDecoder(verifier, drafter, "lookahead")
    seen = {}
    original = drafter.see_extra

    def keep(logits):
        seen["logits"] = logits.clone()
        original(logits)

    drafter.see_extra = keep
    from draftheads.eval.engine.protocol import Sampling

    sampling = Sampling(0.0, 1.0, dec.sampling_generator())
    state = dec.begin(PROMPTS[:1], MAX_NEW, sampling)
    for _ in range(3):  # a few steps: the window holds real Jacobi iterates by then
        committed = state.tokens[0, : state.lengths_host[0] + 1].tolist()
        draft = drafter.propose(state, sampling)
        drafter.propose = lambda *a, d=draft, **k: d  # the step drafts exactly this
        dec.step(state, sampling)
        del drafter.propose
        window = draft.extra.tokens[0].tolist()
        W, depth = drafter.W, drafter.N - 1
        for r in range(depth):
            for j in range(1, W + 1):
                guessed = [window[c - 1] for c in range(1, j + 1)] + [window[q * W + j - 1] for q in range(1, r + 1)]
                with torch.no_grad():
                    want = model(torch.tensor([committed + guessed])).logits[0, -1]
                torch.testing.assert_close(seen["logits"][0, r * W + j - 1], want, rtol=1e-4, atol=1e-4)




@pytest.mark.parametrize("family", FAMILIES)
def test_fused_loop_decodes_like_the_unfused_one(models, family):
    """The fused loop (graphs off on the CPU) with the window's extra nodes in its static buffers: the same greedy
    outputs and decisions as the unfused loop and HF, and the same tokens from the same seed at T > 0."""
    from draftheads.eval.engine.cuda_loop import Buckets, FusedDecoder

    _, verifier, refs = models(family)

    def build():
        return SpeculativeDecoder(verifier, make_drafter("lookahead", verifier, window=3, ngram_size=3), "lookahead")

    plain, fused = build(), FusedDecoder(build(), graphs=False, buckets=Buckets(batch=(1, 4), capacity=64, window=64))
    for prompts in (PROMPTS[:1], PROMPTS):
        want, got = plain.generate(prompts, MAX_NEW), fused.generate(prompts, MAX_NEW)
        assert got.output_ids == want.output_ids == refs[: len(prompts)], family
        assert got.stats.accepted == want.stats.accepted
    sampled = [d.generate(PROMPTS[:1], MAX_NEW, temperature=0.9, seed=3).output_ids for d in (plain, fused)]
    assert sampled[0] == sampled[1]


def test_the_generic_path_refuses_the_window(models):
    from draftheads.eval.engine.runtime import UnsupportedModelError

    _, verifier, _ = models("llama")
    gemma = Verifier(tiny_model("gemma3"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsupportedModelError, match="'gemma3_text' runs on the generic path.*'lookahead'"):
            SpeculativeDecoder(gemma, make_drafter("lookahead", gemma), "lookahead")
    with pytest.raises(ValueError, match="ngram_size=1"):
        make_drafter("lookahead", verifier, ngram_size=1)
    with pytest.raises(ValueError, match="takes no draft"):
        make_drafter("lookahead", verifier, draft="x")
