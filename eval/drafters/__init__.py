"""The drafters: one module per method, and the registry that builds one by name.

    from draftheads.eval import build_decoder
    dec = build_decoder("tiny-code", method="eagle", draft="runs/eagle3-tiny/drafter", chain=4)

The engine (draftheads.eval.engine) never imports this package: it runs any `Drafter` it is handed. Methods:
`autoregressive` (the baseline, same runtime), `ngram` (prompt lookup, ngram.py), `lookahead` (Jacobi window +
n-gram pool, lookahead.py), `draft-model` (vanilla speculative decoding with a small LM; chain or tree,
draft_model.py), `medusa` (heads on the verifier's last hidden state, static tree, medusa.py), `eagle` (EAGLE-1 /
EAGLE-3, chain or EAGLE-2's dynamic tree, eagle.py), `dflash` (block-diffusion drafting: a block of drafts from one
drafter forward, dflash.py; a DFlash2 drafter through its candidate selector, dflash2.py), `mtp` (the verifier's own
multi-token-prediction layer, a chain, mtp.py).
"""

from __future__ import annotations

import inspect

from draftheads.eval.drafters.dflash import DFlashBlockDrafter, dflash_model
from draftheads.eval.drafters.dflash2 import DFlash2BlockDrafter
from draftheads.eval.drafters.draft_model import DraftModelDrafter, load_causal_lm
from draftheads.eval.drafters.eagle import make_eagle
from draftheads.eval.drafters.lookahead import LookaheadDrafter
from draftheads.eval.drafters.medusa import make_medusa
from draftheads.eval.drafters.mtp import make_mtp
from draftheads.eval.drafters.ngram import NgramDrafter
from draftheads.eval.engine.decoder import SpeculativeDecoder, load_verifier
from draftheads.eval.engine.protocol import Drafter, NoDrafter


# ---- the registry -------------------------------------------------------------------------------------------------
def _autoregressive(verifier, draft, device, dtype):
    return NoDrafter()


def _ngram(verifier, draft, device, dtype, num_draft_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1):
    return NgramDrafter(num_draft_tokens, max_ngram, min_ngram)


def _draft_model(verifier, draft, device, dtype, num_draft_tokens: int | None = None, branching=None,
                 tree_sampling: str = "sample"):
    if draft is None:
        raise ValueError("method 'draft-model' needs draft=<a small causal LM folder/name, Verifier or module>")
    if num_draft_tokens is not None and branching is not None:
        raise ValueError("method 'draft-model': give num_draft_tokens (a chain) or branching (a tree), not both")
    num_draft_tokens = 4 if num_draft_tokens is None else num_draft_tokens
    model = load_causal_lm(draft, device=device or verifier.device, dtype=dtype or verifier.dtype)
    return DraftModelDrafter(model, verifier.vocab_size, num_draft_tokens, branching, tree_sampling)


def _lookahead(verifier, draft, device, dtype, window: int = 4, ngram_size: int = 3, guesses: int | None = None,
               context_pool: bool = True):
    return LookaheadDrafter(window, ngram_size, guesses, context_pool)


def _medusa(verifier, draft, device, dtype, paths=None, tree_budget: int | None = None, chain=None,
            tree_sampling: str = "topk", acceptance: str = "lossless", typical_epsilon: float = 0.09,
            typical_alpha: float = 0.3):
    return make_medusa(verifier, draft, paths, tree_budget, chain, tree_sampling, acceptance, typical_epsilon,
                       typical_alpha)


def _eagle(verifier, draft, device, dtype, chain: int | None = None, depth: int = 6, top_k: int = 4,
           total_tokens: int = 16, tree_sampling: str | None = None):
    return make_eagle(verifier, draft, chain, depth, top_k, total_tokens, tree_sampling)


def _dflash(verifier, draft, device, dtype, num_draft_tokens: int | None = None):
    model = dflash_model(verifier, draft)  # DFlash2 (dflash.variant dflash2) drafts through its selector
    engine = DFlash2BlockDrafter if model.cfg.variant == "dflash2" else DFlashBlockDrafter
    return engine(model, num_draft_tokens)


def _mtp(verifier, draft, device, dtype, num_draft_tokens: int = 3):
    return make_mtp(verifier, draft, num_draft_tokens)


METHODS = {"autoregressive": _autoregressive, "ngram": _ngram, "lookahead": _lookahead, "draft-model": _draft_model,
           "medusa": _medusa, "eagle": _eagle, "dflash": _dflash, "mtp": _mtp}


def make_drafter(method: str, verifier, draft=None, device=None, dtype=None, **options) -> Drafter:
    """Build the drafter for `method`; unknown methods and options are errors that list what exists."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    factory = METHODS[method]
    params = list(inspect.signature(factory).parameters)[4:]
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ValueError(f"method {method!r} has no option(s) {', '.join(unknown)}; "
                         f"its options: {', '.join(params) or 'none'}")
    if draft is not None and method in ("autoregressive", "ngram", "lookahead"):
        raise ValueError(f"method {method!r} takes no draft (got draft={draft!r})")
    return factory(verifier, draft, device, dtype, **options)




def build_decoder(verifier, method: str = "autoregressive", draft=None, device=None, dtype=None,
                  first_token: str = "draft", **method_options) -> SpeculativeDecoder:
    """A SpeculativeDecoder for `method`. verifier: a name/folder or a Verifier; draft: what the method needs (a
    draft model for 'draft-model', an exported drafter folder for 'medusa' / 'eagle' / 'dflash'); method_options: the
    method's own options (`make_drafter`)."""
    verifier = load_verifier(verifier, device, dtype)
    drafter = make_drafter(method, verifier, draft, device=device, dtype=dtype, **method_options)
    return SpeculativeDecoder(verifier, drafter, method=method, first_token=first_token)
