"""Sampling is lossless for every method: at T=1 the joint of the first two generated tokens is the verifier's own
(chi-square over 10-20k samples of a 16-token vocabulary, so every pair is enumerable), while drafts are really
rejected, and really accepted, often enough for the check to mean something. One suite, one case per method and
drafter shape; `draftheads.eval.engine.acceptance`'s rules are tested piece by piece in
tests/integration/test_acceptance.py and tests/integration/test_spec_sampling.py."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from draftheads.eval import SpeculativeDecoder
from draftheads.eval.drafters import make_drafter
from draftheads.models.medusa import MedusaHeads
from draftheads.models.verifier import Verifier
from tests.utils import chi2_pvalue, fit_eagle, greedy_corpus, noisy_copy, tiny_model, train_eagle_briefly

V = 16
PROMPT = [3, 7, 1, 9]


@dataclass(frozen=True)
class Case:
    build: Callable[[], tuple[torch.nn.Module, SpeculativeDecoder]]
    """() -> (the verifier's model, a decoder over it)."""
    prompt: list[int]
    rows: int = 5000
    rounds: int = 4
    first_rejected: tuple[float, float] = (0.1, 0.9)
    """Bounds on the share of steps whose first draft token was rejected."""
    min_deep: int | None = None
    """More than this many steps accepted two drafts or more."""
    lossless_flag: bool = False
    """Also assert the run reports itself lossless, every round."""


@functools.cache
def small_vocab_eagle():
    """A 16-token verifier and a partially right EAGLE drafter per version (and a parallel EAGLE-3)."""
    model = tiny_model("llama", seed=0, vocab_size=V, num_layers=4, initializer_range=0.2)
    verifier = Verifier(model)
    g = torch.Generator().manual_seed(2)
    corpus = greedy_corpus(model, [PROMPT] + torch.randint(0, V, (16, 4), generator=g).tolist(), 12)
    return model, verifier, corpus


@functools.cache
def eagle_drafter(version: int):
    _, verifier, corpus = small_vocab_eagle()
    return fit_eagle(verifier, version, corpus, **({"draft_vocab_size": 12} if version == 3 else {}))


def eagle(version: int, **options):
    def build():
        model, verifier, _ = small_vocab_eagle()
        drafter = make_drafter("eagle", verifier, eagle_drafter(version), **options)
        return model, SpeculativeDecoder(verifier, drafter, "eagle")
    return build


def eagle_parallel():
    model, verifier, corpus = small_vocab_eagle()
    drafter = fit_eagle(verifier, 3, corpus, draft_vocab_size=12, ttt_steps=3, parallel=True)
    return model, SpeculativeDecoder(verifier, make_drafter("eagle", verifier, drafter, chain=3), "eagle")


def dflash(draft_vocab_size: int | None = None, **variant):
    """A DFlash drafter (block 4: three drafts from one forward, each drawn from its own distribution) trained a
    few steps on the verifier's own continuations; with `draft_vocab_size`, its own lm_head over the most frequent
    tokens of that corpus (its draft distributions zero on the others); `variant` (dflash.variant=dflash2 and its
    keys): DFlash2, each draft drawn from the selector's scores after the draft before it."""
    from draftheads.models.dflash import DFlashConfig
    from draftheads.models.dflash2 import build_drafter
    from draftheads.models.eagle import count_tokens

    def build():
        model, verifier, corpus = small_vocab_eagle()
        torch.manual_seed(0)
        cfg = DFlashConfig(num_hidden_layers=1, block_size=4, target_layer_ids=[0, 2], mask_token_id=0,
                           num_anchors=16, draft_vocab_size=draft_vocab_size, **variant)
        ids = torch.tensor([token for row in corpus for token in row])
        counts = count_tokens(ids, torch.ones_like(ids), V)
        drafter = train_eagle_briefly(build_drafter(verifier, cfg, token_counts=counts), verifier, corpus, steps=12,
                                      lr=1e-2)
        return model, SpeculativeDecoder(verifier, make_drafter("dflash", verifier, drafter), "dflash")
    return build


def medusa(tree_sampling: str):
    """Tree [(0,), (1,), (0, 0), (1, 0), (0, 1)] of heads copied from the verifier's own head (one step early)."""
    def build():
        model = tiny_model("llama", seed=0, vocab_size=V, num_layers=2, initializer_range=0.2)
        verifier = Verifier(model)
        heads = MedusaHeads.from_verifier(verifier, num_heads=3)
        paths = [(0,), (1,), (0, 0), (1, 0), (0, 1)]
        drafter = make_drafter("medusa", verifier, heads, paths=paths, tree_sampling=tree_sampling)
        return model, SpeculativeDecoder(verifier, drafter, "medusa")
    return build


def lookahead():
    model = tiny_model("llama", seed=0, vocab_size=V, num_layers=4, initializer_range=0.2)
    verifier = Verifier(model)
    drafter = make_drafter("lookahead", verifier, window=3, ngram_size=2, guesses=3)
    return model, SpeculativeDecoder(verifier, drafter, "lookahead")


def family(name: str, method: str):
    """Qwen3 (static cache) with a noisy copy as draft model; Gemma 3 (the generic path) with n-gram drafts."""
    def build():
        model = tiny_model(name, seed=0, vocab_size=V, initializer_range=0.2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            verifier = Verifier(model)
            draft = noisy_copy(model, 0.5) if method == "draft-model" else None
            dec = SpeculativeDecoder(verifier, make_drafter(method, verifier, draft, num_draft_tokens=2), method)
        return model, dec
    return build


CASES = {
    # EAGLE-3's draft vocabulary (12 of 16 tokens) leaves its sampled draft distribution zero on the other four,
    # which the lossless rule must see.
    "eagle1-tree": Case(eagle(1, depth=3, top_k=3, total_tokens=8), PROMPT),
    "eagle3-tree": Case(eagle(3, depth=3, top_k=2, total_tokens=5), PROMPT),
    "eagle3-chain-sampled": Case(eagle(3, chain=3), PROMPT),
    # the second draft of each step comes from a mask position, and is accepted too
    "eagle3-parallel": Case(eagle_parallel, PROMPT, min_deep=100),
    # drafts 2 and 3 come from mask positions of the same block, and are accepted too
    "dflash": Case(dflash(), PROMPT, min_deep=100),
    # its own lm_head over 12 of the 16 tokens: zero draft probability on the other four
    "dflash-own-head": Case(dflash(12), PROMPT, min_deep=100),
    # DFlash2: drafts drawn from the top 4 of 16 candidates (zero elsewhere), each after the draw before it
    "dflash2": Case(dflash(variant="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4), PROMPT,
                    min_deep=100),
    "medusa-tree-sample": Case(medusa("sample"), PROMPT, first_rejected=(0.1, 0.95), lossless_flag=True),
    "medusa-tree-topk": Case(medusa("topk"), PROMPT, first_rejected=(0.1, 0.95), lossless_flag=True),
    "lookahead": Case(lookahead, PROMPT * 3, first_rejected=(0.05, 0.95)),
    "qwen3-draft-model": Case(family("qwen3", "draft-model"), PROMPT + PROMPT[:2], first_rejected=(0.02, 0.98)),
    # the generic path decodes row by row: fewer samples
    "gemma3-ngram": Case(family("gemma3", "ngram"), PROMPT + PROMPT[:2], rows=800, rounds=2,
                         first_rejected=(0.02, 0.98)),
}


def verifier_joint(model, prompt: list[int]) -> torch.Tensor:
    """P(first two new tokens) under the verifier's own sampling at T=1: (V, V)."""
    with torch.no_grad():
        q0 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        q1 = torch.softmax(model(torch.tensor([prompt + [x] for x in range(V)])).logits[:, -1].double(), -1)
    return q0[:, None] * q1


@pytest.mark.parametrize("name", list(CASES))
def test_sampling_is_lossless(name):
    case = CASES[name]
    model, dec = case.build()
    counts = torch.zeros(V * V, dtype=torch.long)
    accepted = []
    for seed in range(case.rounds):
        out = dec.generate([case.prompt] * case.rows, 2, temperature=1.0, seed=seed, eos_token_id=None)
        if case.lossless_flag:
            assert out.stats.lossless
        pairs = torch.tensor(out.output_ids)
        counts += torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
        accepted += [row[0] for row in out.stats.accepted]
    assert chi2_pvalue(counts, verifier_joint(model, case.prompt)) > 0.001
    lo, hi = case.first_rejected
    assert lo < sum(a == 0 for a in accepted) / len(accepted) < hi, "drafts should be rejected only sometimes"
    if case.min_deep is not None:
        assert sum(a >= 2 for a in accepted) > case.min_deep
