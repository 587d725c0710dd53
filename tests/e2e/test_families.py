"""Every verifier family, every method: what runs where, proven by decoding.

Static-cache runtime: Llama, Qwen2, Mistral, Qwen3 (q/k norms, head_dim apart from hidden/heads) and Qwen3-MoE.
Generic path (the model's own forward and cache, chains only): Gemma 3 (sliding-window layers, scaled embeddings,
(1 + w) norms), OLMo 2 and Phi-3. For each family and method, greedy output on one prompt and on a ragged batch of
three equals the model's own `generate(do_sample=False)`, or the method is refused with one line naming the model
type and the method. The table this produces is docs/families.md (`DRAFTHEADS_WRITE_DOCS=1` rewrites it).
Also: sampling at T=1 is lossless on Qwen3 (static) and Gemma 3 (generic), and the trainers train, export and
check a drafter on Qwen3, Qwen3-MoE, Gemma 3 and OLMo 2.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from draftheads.eval import SpeculativeDecoder
from draftheads.eval.drafters import make_drafter
from draftheads.eval.engine.runtime import UnsupportedModelError
from draftheads.models.export import export_eagle, save_medusa
from draftheads.models.medusa import MedusaHeads
from draftheads.models.verifier import Verifier
from tests.utils import (
    GENERIC_FAMILIES,
    STATIC_FAMILIES,
    fit_eagle,
    greedy_corpus,
    hf_greedy,
    noisy_copy,
    peaked_model,
    tiny_config,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "families.md"
ALL_FAMILIES = STATIC_FAMILIES + GENERIC_FAMILIES
MAX_NEW = 16
PROMPTS = [[5, 77, 31, 200, 9, 77, 31], [42], [8, 8, 120, 3, 64, 19, 250, 7, 120, 3, 64]]

#: (column, method, what to build from, options)
METHODS = [
    ("autoregressive", "autoregressive", None, {}),
    ("ngram", "ngram", None, {"num_draft_tokens": 3}),
    ("draft-model chain", "draft-model", "draft", {"num_draft_tokens": 3}),
    ("draft-model tree", "draft-model", "draft", {"branching": [2, 2]}),
    ("medusa chain", "medusa", "medusa", {"chain": 3}),
    ("medusa tree", "medusa", "medusa", {}),
    ("eagle-1 chain", "eagle", "eagle1", {"chain": 3}),
    ("eagle-3 chain", "eagle", "eagle3", {"chain": 3}),
    ("eagle-3 tree", "eagle", "eagle3", {"depth": 3, "top_k": 2, "total_tokens": 6}),
]


def drafters_for(model, verifier, folder: Path) -> dict:
    """What each method drafts with, for this verifier: a noisy copy as draft model, Medusa heads saved as an export
    (started from the verifier's head), EAGLE-1 and EAGLE-3 fitted on its own greedy text and exported."""
    corpus = greedy_corpus(model, PROMPTS + [[17, 3, 99, 4], [250, 251, 2, 60, 61]], 24)
    save_medusa(folder / "medusa", MedusaHeads.from_verifier(verifier, num_heads=3), verifier,
                tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]], rank_accuracy=None)
    for version in (1, 3):
        drafter = fit_eagle(verifier, version, corpus, draft_vocab_size=128 if version == 3 else None)
        export_eagle(drafter, folder / f"eagle{version}", verifier)
    return {"draft": noisy_copy(model), "medusa": str(folder / "medusa"), "eagle1": str(folder / "eagle1"),
            "eagle3": str(folder / "eagle3")}


def support_row(family: str, folder: Path) -> dict[str, str]:
    """Decode every method on `family`; assert each either equals HF greedy (batch 1 and 3) or is refused in one
    line naming the model type and the method. Returns {column: "static" | "generic" | "refused"}."""
    model = peaked_model(family)
    verifier = Verifier(model)
    refs = [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    made = drafters_for(model, verifier, folder)
    row = {}
    for column, method, source, options in METHODS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                drafter = make_drafter(method, verifier, made.get(source), **options)
                dec = SpeculativeDecoder(verifier, drafter, method)
            except UnsupportedModelError as err:
                text = str(err)
                assert family in GENERIC_FAMILIES, (family, column, text)
                assert repr(model.config.model_type) in text and "chain" in text and "\n" not in text, text
                row[column] = "refused"
                continue
        one = dec.generate([PROMPTS[0]], MAX_NEW, eos_token_id=None)
        batch = dec.generate(PROMPTS, MAX_NEW, eos_token_id=None)
        assert one.output_ids == refs[:1], (family, column)
        assert batch.output_ids == refs, (family, column)
        row[column] = "generic" if getattr(dec.runner, "generic", False) else "static"
    return row


ROWS: dict[str, dict[str, str]] = {}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_method_greedy_or_refused(family, tmp_path):
    ROWS[family] = row = support_row(family, tmp_path)
    if family in STATIC_FAMILIES:
        assert set(row.values()) == {"static"}, row
    else:
        assert {c for c, v in row.items() if v == "refused"} == {"draft-model tree", "medusa tree", "eagle-3 tree"}
        assert {v for v in row.values() if v != "refused"} == {"generic"}, row


def table(rows: dict[str, dict[str, str]]) -> str:
    columns = [c for c, *_ in METHODS]
    lines = ["| model_type | path | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for family in ALL_FAMILIES:
        row = rows[family]
        path = "static cache" if family in STATIC_FAMILIES else "generic"
        lines.append(f"| {tiny_config(family).model_type} | {path} | " + " | ".join(row[c] for c in columns) + " |")
    return "\n".join(lines)


def test_docs_table_is_what_the_engine_does(tmp_path):
    """docs/families.md holds the table decoded above (families the parametrized test did not run, under -k, are
    decoded here)."""
    rows = dict(ROWS)
    for family in ALL_FAMILIES:
        if family not in rows:
            rows[family] = support_row(family, tmp_path / family)
    text = table(rows)
    begin, end = "<!-- table: tests/e2e/test_families.py -->", "<!-- end table -->"
    doc = DOC.read_text()
    head, rest = doc.split(begin)
    current, tail = rest.split(end)
    current = current.strip()
    if os.environ.get("DRAFTHEADS_WRITE_DOCS") == "1":
        DOC.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
    else:
        assert current == text, "docs/families.md is stale: DRAFTHEADS_WRITE_DOCS=1 python -m pytest " \
                                "tests/e2e/test_families.py rewrites it"


def test_generic_path_says_so_once():
    from draftheads.eval.engine import generic_runtime

    generic_runtime._announced.discard("olmo2")
    verifier = Verifier(tiny_model("olmo2"))
    with pytest.warns(UserWarning, match="'olmo2' runs on the generic path.*slower"):
        SpeculativeDecoder(verifier, method="autoregressive")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeculativeDecoder(verifier, method="autoregressive")  # said once per model type, not per decoder


def test_fused_loop_refuses_the_generic_path():
    from draftheads.eval.engine.cuda_loop import FusedDecoder

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dec = SpeculativeDecoder(Verifier(tiny_model("gemma3")), method="autoregressive")
    with pytest.raises(ValueError, match="'gemma3_text' runs on the generic path"):
        FusedDecoder(dec)


def soft_capped(vocab_size: int = 256):
    from transformers import AutoModelForCausalLM, Gemma2Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, final_logit_softcapping=0.5, initializer_range=0.5)).eval()


def test_a_soft_capped_head_is_refused(tmp_path):
    """Gemma 2 soft-caps its logits: lm_head(final) is not the model's output, which verification and training on
    features need. The engine and the trainers refuse it in one line naming the model type."""
    from draftheads.models.verifier import VerifierError
    from tests.chat_tokenizers import plain_tokenizer
    from tests.e2e.test_train_eagle import run as run_eagle
    from tests.e2e.test_train_eagle import tiny_args

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(VerifierError, match="'gemma2'.*not lm_head\\(final hidden state\\)"):
            SpeculativeDecoder(Verifier(soft_capped()), method="autoregressive")
        tokenizer = plain_tokenizer()
        soft_capped(-(-len(tokenizer) // 64) * 64).save_pretrained(tmp_path / "gemma2", safe_serialization=True)
        tokenizer.save_pretrained(tmp_path / "gemma2")
        with pytest.raises(VerifierError, match="'gemma2'.*training a drafter on its features"):
            run_eagle(*tiny_args(tmp_path / "gemma2", tmp_path / "run", 3, stdlib=True))




# ---- training ----------------------------------------------------------------------------------------------------
TRAINED = ("qwen3", "qwen3_moe", "gemma3", "olmo2")


@pytest.fixture(scope="module")
def trained_verifiers(tmp_path_factory):
    from tests.utils import save_tiny_verifier_with_tokenizer

    root = tmp_path_factory.mktemp("family-verifiers")
    return {family: save_tiny_verifier_with_tokenizer(root / family, family) for family in TRAINED}


@pytest.mark.usefixtures("fresh_accelerate")
@pytest.mark.parametrize("family", TRAINED)
def test_trainers_train_export_and_check(family, trained_verifiers, tmp_path):
    """Medusa, EAGLE-1 and EAGLE-3 train a few steps on the family's features, export, and pass the trainers' own
    train/serve check (the export, reloaded, decodes like the trained drafter in our engine: on the generic path
    as chains); EAGLE-3's export names the Llama layer the engines build, with the verifier's head_dim."""
    import json

    from draftheads.models.export import load_eagle
    from tests.e2e.test_train_eagle import run as run_eagle
    from tests.e2e.test_train_eagle import tiny_args
    from tests.e2e.test_train_medusa import run as run_medusa
    from tests.utils import reset_accelerate

    folder = trained_verifiers[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eagle = run_eagle(*tiny_args(folder, tmp_path / "eagle3", 3, "--train.max_steps=2", stdlib=True))
        reset_accelerate()
        eagle1 = run_eagle(*tiny_args(folder, tmp_path / "eagle1", 1, "--train.max_steps=2", stdlib=True))
        reset_accelerate()
        medusa = run_medusa(folder, tmp_path / "medusa")
    for summary in (eagle, eagle1, medusa):
        checked = summary["consistency"]
        assert checked["tau"] == checked["tau_in_memory"] and checked["new_tokens"] > 0, checked
    config = json.loads((tmp_path / "eagle3" / "drafter" / "config.json").read_text())
    vc = tiny_config(family)
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["head_dim"] == (getattr(vc, "head_dim", None) or vc.hidden_size // vc.num_attention_heads)
    verifier = Verifier.from_pretrained(folder)
    drafter = load_eagle(tmp_path / "eagle3" / "drafter", verifier)
    assert drafter.model_type == vc.model_type and type(drafter.layer).__name__ == "LlamaDecoderLayer"
