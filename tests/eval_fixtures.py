"""A tiny evaluation setup for the eval CLI and benchmark tests: a peaked random Llama (vocab 512) saved with a
500-token BPE, a noisy copy of it as a draft model (same tokenizer), and an EAGLE-3 export fitted on the
verifier's greedy continuations of the first HumanEval prompts."""

from __future__ import annotations

from pathlib import Path


def build_eval_setup(root: Path, **size) -> Path:
    from draftheads.data.prompts import load_prompts, prompt_ids
    from draftheads.models.export import export_eagle
    from draftheads.models.verifier import Verifier
    from tests.chat_tokenizers import plain_tokenizer
    from tests.utils import fit_eagle, greedy_corpus, noisy_copy, peaked_model

    tok = plain_tokenizer()
    eos = tok.eos_token_id
    model = peaked_model("llama", vocab_size=512, max_position_embeddings=1024, eos_token_id=eos, pad_token_id=eos,
                         bos_token_id=None, **size)
    model.save_pretrained(root / "verifier")
    tok.save_pretrained(root / "verifier")
    draft = noisy_copy(model, 0.1)
    draft.save_pretrained(root / "draft")
    tok.save_pretrained(root / "draft")
    verifier = Verifier.from_pretrained(root / "verifier")
    prompts = [prompt_ids(p, tok) for p in load_prompts("humaneval", 3)]
    drafter = fit_eagle(verifier, 3, greedy_corpus(verifier.model, prompts, 16), draft_vocab_size=256)
    export_eagle(drafter, root / "eagle3", verifier)
    return root
