"""The `eagle` method with a sliding-window EAGLE-3 drafter (eagle.sliding_window): the engine's drafts, chain and
EAGLE-2 dynamic tree, equal a slow reference that reruns the drafter without a cache over prefix + path (where the
window is applied by position, as vLLM's KV cache applies it), with windows shorter than the tree's depth and than
the prompts; greedy output equals Hugging Face greedy decoding; and the window changes the drafts (the check can
fail)."""

import functools

import pytest
import torch

from draftheads.eval import SpeculativeDecoder
from draftheads.eval.drafters import make_drafter
from draftheads.eval.engine.protocol import Sampling
from draftheads.models.export import export_eagle
from tests.e2e.test_decode_eagle import MAX_NEW, PROMPTS, fitted, slow_dynamic_tree
from draftheads.models.eagle import EagleConfig, build_drafter
from tests.utils import peaked_with_references, unsettle_norms_and_biases

pytestmark = pytest.mark.usefixtures("one_thread")

ATTENTION_GAIN = 4.0
MODES = {"chain": (dict(chain=4), (4, 1, 4)), "tree": (dict(depth=6, top_k=2, total_tokens=18), (6, 2, 18))}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per (window, kind): the peaked Llama verifier, HF greedy references and an exported EAGLE-3 folder, the same
    weights for every window: kind "fitted" accepts part of the time (tests.utils.fit_eagle); kind "random" is a
    random drafter whose attention output is scaled up, so that a key let into or left out of the window moves
    its top-k picks (the fitted one's drafts hardly depend on attention)."""
    model, verifier, refs = peaked_with_references("llama", [p for ps in PROMPTS.values() for p in ps], MAX_NEW)
    drafters = {"fitted": fitted(model, verifier, 3)}
    torch.manual_seed(0)
    drafters["random"] = unsettle_norms_and_biases(build_drafter(verifier, EagleConfig(draft_vocab_size=None))).eval()
    with torch.no_grad():
        drafters["random"].layer.self_attn.o_proj.weight.mul_(ATTENTION_GAIN)

    @functools.cache
    def get(window, kind="random"):
        drafter = drafters[kind]
        drafter.cfg.sliding_window = window
        folder = export_eagle(drafter, tmp_path_factory.mktemp(f"window-{window}-{kind}"), verifier)
        return verifier, refs, folder

    return get


def engine_drafts(verifier, folder, options, reference=None, steps=6):
    """The engine's drafts over `steps` decode steps of the ragged batch, each checked against `reference` (depth,
    top_k, total) when given; returns every draft's tokens."""
    drafter = make_drafter("eagle", verifier, str(folder), **options)
    dec = SpeculativeDecoder(verifier, drafter, "eagle")
    sampling, prompts, seen = Sampling(), PROMPTS[3], []
    with torch.inference_mode():
        state = dec.begin(prompts, 20, sampling)
        for step in range(steps):
            draft = dec.draft(state, sampling)
            seen.append(draft.tokens.tolist())
            for b in range(len(prompts)):
                L = state.lengths_host[b]
                if L == 0 or reference is None:
                    continue
                ids = state.tokens[b, : L + 1].tolist()
                with torch.no_grad():
                    tokens, parents = slow_dynamic_tree(drafter.model, verifier, ids, *reference)
                assert draft.tokens[b].tolist() == tokens, (step, b)
                tree = draft.tree.parents  # (B or 1, N+1): a chain's one tree serves every row
                assert tree[min(b, len(tree) - 1), 1:].tolist() == parents, (step, b)
            out = dec.verify(state, draft)
            committed = dec.commit(state, draft, dec.accept(draft, out, sampling), out)
            dec.drafter.observe(state, committed)
            state.lengths_host = state.lengths.tolist()
    return seen


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("window", [2, 5])  # shorter than the depth (ancestors leave the window), than the prompts
def test_windowed_drafts_match_the_slow_reference(exported, mode, window):
    verifier, _, folder = exported(window)
    options, reference = MODES[mode]
    windowed = engine_drafts(verifier, folder, options, reference)
    _, _, full = exported(None)
    assert windowed != engine_drafts(verifier, full, options), "the window changed no draft: the test shows nothing"


@pytest.mark.parametrize("mode", list(MODES))
def test_windowed_greedy_equals_hf_generate(exported, mode):
    verifier, refs, folder = exported(3, "fitted")
    dec = SpeculativeDecoder(verifier, make_drafter("eagle", verifier, str(folder), **MODES[mode][0]), "eagle")
    assert dec.drafter.describe()["sliding_window"] == 3
    for prompts in PROMPTS.values():
        out = dec.generate(prompts, MAX_NEW)
        assert out.output_ids == [refs[tuple(p)] for p in prompts]
        assert sum(a for row in out.stats.accepted for a in row) > 0
