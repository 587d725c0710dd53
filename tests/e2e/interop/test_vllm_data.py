"""vLLM as the data engine (the CPU build of 0.32 in .venv-vllm: `bash scripts/setup_vllm.sh`).

`draftheads dump-features --backend vllm` against the Hugging Face dump of the same rows, on tiny Llama and Qwen3
verifiers in fp32 (packed rows: several documents and right padding in one row): the token columns are equal, every
feature (EAGLE-3's three layer inputs and the final post-norm state) is equal per layer and position within fp32
rounding, the cache passes `draftheads cache verify`, and EAGLE-3 trains from it with the losses of the HF cache.
A shard deleted after the dump is written again with the same bytes. Bad input ends in one line.

Each vLLM start costs ~20 s of CPU, so each family's vLLM dump runs once (module-scoped fixture).
    pytest tests/e2e/interop/test_vllm_data.py -s      # prints the max abs / relative error per family and key
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from draftheads.data.hidden_states import read_index
from draftheads.data.hidden_states import main as cache_cli
from draftheads.data.identity import sha256_file
from draftheads.models.verifier import Verifier
from draftheads.train.config import parse_config
from draftheads.train.dump_features import dump
from draftheads.train.dump_features import main as dump_cli
from tests.utils import reset_accelerate, save_tiny_verifier_with_tokenizer, tiny_eagle3_args

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[3]
FAMILIES = ("llama", "qwen3")
SIZE = dict(hidden_size=128, initializer_range=0.1)  # vLLM's CPU attention needs head_dim >= 32 (4 heads)
TOL = 1e-5  # fp32: relative to the largest value of the key


eagle3_args = tiny_eagle3_args


def eagle_cfg(*args):
    from draftheads.train.eagle import EagleRunConfig

    return parse_config(EagleRunConfig, list(args))


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def text_rows(tmp_path_factory):
    """Documents of different lengths, so rows pack several of them and some end in padding."""
    path = tmp_path_factory.mktemp("engine-data") / "rows.jsonl"
    lines = [{"text": f"def f{i}(x):\n    return x * {i} + {i * i}  # number {i}\n" * (1 + i % 3)} for i in range(14)]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def caches(request, tmp_path_factory, text_rows, vllm_ready):
    """(verifier folder, HF cache, vLLM cache) of one family, each dumped once."""
    family = request.param
    root = tmp_path_factory.mktemp(f"engine-{family}")
    verifier = save_tiny_verifier_with_tokenizer(root / "verifier", family, **SIZE)
    folders = {}
    for backend in ("hf", "vllm"):
        reset_accelerate()
        cfg = eagle_cfg(*eagle3_args(verifier, text_rows, root / "unused"))
        folders[backend] = root / backend
        result = dump(cfg, folders[backend], dtype="float32", rows_per_shard=4, say=quiet, backend=backend)
        assert result.written and not result.skipped
    reset_accelerate()
    return family, verifier, folders["hf"], folders["vllm"]


def shards(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {path.name: load_file(path) for path in sorted(folder.glob("*.safetensors"))}


def test_vllm_features_equal_hf_per_layer_and_position(caches):
    family, _, hf, vllm = caches
    index = read_index(vllm)
    assert index["backend"] == "vllm" and read_index(hf)["backend"] == "hf"
    assert {k: v for k, v in index.items() if k not in ("backend", "splits", "total_bytes")} == \
        {k: v for k, v in read_index(hf).items() if k not in ("backend", "splits", "total_bytes")}
    ours, theirs = shards(hf), shards(vllm)
    assert ours.keys() == theirs.keys() and ours
    head = Verifier.load_head(caches[1], dtype="float32", device="cpu")
    worst, packed = {}, 0
    for name, a in ours.items():
        b = theirs[name]
        assert a.keys() == b.keys()
        packed += int((a["position_ids"][:, 1:] == 0).sum())
        for key in a:
            if key == "argmax":  # each the argmax of its own final: equal, or a tie within the features' tolerance
                logits = head.lm_head(a["final"])
                top = logits.max(-1).values
                theirs_top = logits.gather(-1, b[key].long()[..., None])[..., 0]
                assert torch.equal(a[key].long(), logits.max(-1).indices), (name, key)
                assert ((a[key] == b[key]) | (top - theirs_top <= 1e-4 * top.abs().clamp(min=1))).all(), (name, key)
                continue
            if not a[key].is_floating_point():
                assert torch.equal(a[key], b[key]), (name, key)
                continue
            err = (a[key] - b[key]).abs()
            scale = a[key].abs().max()
            worst[key] = max(worst.get(key, (0.0, 0.0)), (float(err.max()), float(err.max() / scale)))
            assert err.max() <= TOL * scale, f"{family} {name} {key}: max abs error {float(err.max()):.3g}"
    assert packed >= 3, "the rows must pack several documents for the comparison to cover them"
    assert set(worst) == {"final", "layers"}
    print(f"\n{family}: vLLM vs HF features, max abs / relative error: "
          + ", ".join(f"{k} {a:.2e} / {r:.2e}" for k, (a, r) in sorted(worst.items())))


def test_vllm_cache_verifies_and_trains_like_the_hf_cache(caches, text_rows, tmp_path, capsys):
    from draftheads.train.eagle import main

    family, verifier, hf, vllm = caches
    assert cache_cli(["verify", str(vllm)]) == 0
    assert "OK" in capsys.readouterr().out
    losses = {}
    for name, folder in (("hf", hf), ("vllm", vllm)):
        reset_accelerate()
        main(eagle_cfg(*eagle3_args(verifier, text_rows, tmp_path / name, "--features=offline",
                                    f"--feature_cache={folder}")))
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [{k: v for k, v in r.items() if "loss" in k} for r in records]
        losses[name] = [r for r in losses[name] if r]  # train steps and the eval
    reset_accelerate()
    assert sum("train/loss" in r for r in losses["vllm"]) == 3
    for a, b in zip(losses["hf"], losses["vllm"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (family, key)


@pytest.mark.parametrize("caches", FAMILIES[:1], indirect=True)  # one family: a vLLM start each
def test_a_lost_shard_is_captured_again_to_the_same_bytes(caches, text_rows, tmp_path):
    family, verifier, _, vllm = caches
    folder = tmp_path / "cache"
    shutil.copytree(vllm, folder)
    lost = "train-00001.safetensors"
    want = sha256_file(folder / lost)
    (folder / lost).unlink()  # as a crash before the sidecar: the shard is not done
    (folder / lost.replace(".safetensors", ".json")).unlink()
    (folder / "index.json").unlink()
    reset_accelerate()
    cfg = eagle_cfg(*eagle3_args(verifier, text_rows, tmp_path / "unused"))
    result = dump(cfg, folder, dtype="float32", rows_per_shard=4, say=quiet, backend="vllm")
    reset_accelerate()
    assert result.written == [lost] and len(result.skipped) >= 3
    assert sha256_file(folder / lost) == want
    assert json.loads((folder / "index.json").read_text()) == json.loads((vllm / "index.json").read_text())
    assert not (folder / ".vllm-states").exists()


def run_cli(args, capsys) -> tuple[int, list[str]]:
    reset_accelerate()
    code = dump_cli(args)
    reset_accelerate()
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    return code, [line for line in lines if line.strip() and "it/s]" not in line]  # not transformers' progress bars


@pytest.mark.parametrize("caches", FAMILIES[:1], indirect=True)  # one family: a vLLM start each
def test_bad_input_ends_in_one_line(caches, text_rows, tmp_path, capsys, monkeypatch):
    family, verifier, _, vllm = caches
    base = ["--dtype", "float32", "--backend", "vllm",
            *eagle3_args(verifier, text_rows, tmp_path / "unused")]
    # a layer the verifier lacks (4 layers): refused before vLLM starts
    code, err = run_cli([*base, "--out", str(tmp_path / "a"), "--eagle.layer_ids=[1,2,9]"], capsys)
    assert code != 0 and len(err) == 1 and "[9] out of range" in err[0], err
    # a cache started by the other backend is not continued by this one
    code, err = run_cli([*[a for a in base if a not in ("--backend", "vllm")], "--backend", "hf",
                         "--out", str(tmp_path / "b")], capsys)
    assert code == 0
    (tmp_path / "b" / "index.json").unlink()
    code, err = run_cli([*base, "--out", str(tmp_path / "b")], capsys)
    assert code == 2 and len(err) == 1 and "backend='hf'" in err[0] and "backend='vllm'" in err[0], err
    # no vLLM: the set-up command, before anything is written
    import draftheads.eval.interop.vllm_peer as peer

    monkeypatch.delenv("DRAFTHEADS_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(peer, "ROOT", tmp_path / "no-checkout")
    code, err = run_cli([*base, "--out", str(tmp_path / "c")], capsys)
    assert code == 2 and len(err) == 1 and "bash scripts/setup_vllm.sh" in err[0], err
    assert not (tmp_path / "c" / "plan.json").exists()


def test_a_verifier_vllm_cannot_run_is_one_line_from_vllm(tmp_path, text_rows, vllm_ready, capsys):
    """head_dim 16: Hugging Face runs it, vLLM's CPU attention does not; vLLM's own message, in one line."""
    verifier = save_tiny_verifier_with_tokenizer(tmp_path / "verifier", "llama", hidden_size=64)
    code, err = run_cli(["--dtype", "float32", "--backend", "vllm", "--out", str(tmp_path / "cache"),
                         *eagle3_args(verifier, text_rows, tmp_path / "unused")], capsys)
    assert code == 2 and len(err) == 1, err
    assert "vLLM failed" in err[0] and "head_dim=16" in err[0], err


# ---- regeneration ---------------------------------------------------------------------------------------------------
MAX_NEW = 24


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory, vllm_ready):
    """Chat and text rows regenerated at T = 0 by both backends (one vLLM start), and the first turns' new token
    ids from each, with the fp32 verifier to judge where they part."""
    from draftheads.data.chat import end_of_turn_ids, render_chat, resolve_chat_template
    from draftheads.train.regenerate import generate_batch, load_for_generation, regenerate
    from draftheads.train.vllm_backend import VllmGenerator
    from tests.chat_tokenizers import chatml_tokenizer
    from tests.unit.test_data_chat import CONVERSATION
    from tests.utils import save_tiny_verifier

    tok = chatml_tokenizer()
    folder = save_tiny_verifier(tmp_path_factory.mktemp("regen") / "verifier", "llama", vocab_size=len(tok),
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **SIZE)
    tok.save_pretrained(folder)
    chats = [{"messages": CONVERSATION}, {"messages": [{"role": "user", "content": "Hi"}]}]
    chats += [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} * {i + 3}?"},
                            {"role": "assistant", "content": "old"}, {"role": "user", "content": "Why?"}]}
              for i in range(10)]
    texts = [{"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 2} for i in range(12)]
    model, tokenizer = load_for_generation(folder, "float32", "cpu")
    template = resolve_chat_template(tokenizer, None)
    stop_ids = end_of_turn_ids(tokenizer, template)
    prompts = [tokenizer(render_chat([m for m in row["messages"] if m["role"] != "assistant"][:1], tokenizer,
                                     template, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for row in chats]
    rows, ids = {}, {}
    with VllmGenerator.start(folder, "float32", seed=0) as vllm:
        for backend, m, batch in (("hf", model, 4), ("vllm", vllm, 256)):
            rows[backend] = [list(regenerate(m, tokenizer, source, max_new_tokens=MAX_NEW, batch_size=batch,
                                             prefix_tokens=8, progress=False)) for source in (chats, texts)]
            ids[backend] = generate_batch(m, prompts, [], tokenizer.pad_token_id, MAX_NEW, 0.0)  # no stop
    return {"rows": rows, "ids": ids, "prompts": prompts, "model": model}


def test_vllm_regenerates_the_rows_hf_does_at_temperature_zero(regenerated):
    hf, vllm = regenerated["rows"]["hf"], regenerated["rows"]["vllm"]
    same = sum(a == b for h, v in zip(hf, vllm, strict=True) for a, b in zip(h, v, strict=True))
    total = sum(len(h) for h in hf)
    print(f"\nregenerate --backend vllm vs hf at T = 0: {same} of {total} rows identical")
    assert total == 24 and same == total


def test_vllm_greedy_tokens_part_from_hf_only_at_near_ties(regenerated):
    """Token by token, with no stop: where the two differ, the fp32 verifier's top two logits at the first
    difference are within 1e-4 of each other (a near-tie the two computations may round either way)."""
    model, prompts = regenerated["model"], regenerated["prompts"]
    parted = []
    for prompt, a, b in zip(prompts, regenerated["ids"]["hf"], regenerated["ids"]["vllm"], strict=True):
        assert len(a) == len(b) == MAX_NEW
        j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + a[:j]])).logits[0, -1].float()
        top = logits.topk(2).values
        parted.append((j, float(top[0] - top[1])))
    print(f"\ngreedy tokens, vLLM vs HF: {len(prompts) - len(parted)} of {len(prompts)} prompts identical for "
          f"{MAX_NEW} tokens; parted at (token, top-2 logit gap): {parted}")
    assert all(gap <= 1e-4 for _, gap in parted), parted
