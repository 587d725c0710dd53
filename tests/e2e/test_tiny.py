"""The embedded default verifier: tokenizer, chat template, data order, held-out metric, builds and the cache."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from draftheads.data.stdlib import read_source, stdlib_files
from draftheads.models import tiny

ROOT = Path(__file__).resolve().parents[2]

#: A build that takes a few seconds: every stage of the real one, at toy size.
TOY = dict(vocab_size=300, tokenizer_files=12, train_files=12, eval_files=1, hidden_size=32, intermediate_size=64,
           num_layers=4, num_heads=2, num_kv_heads=1, seq_len=32, batch_size=2, steps=4, warmup_steps=1)


@pytest.fixture(scope="module")
def small_tokenizer():
    return tiny.train_tokenizer([read_source(p) for p in stdlib_files("verifier")[:20]], vocab_size=400)


def looks_like_python(text: str) -> bool:
    """Two signs of Python: a keyword or builtin among the words, and an indented line or a call/def with parens."""
    words = set(text.replace("(", " ").replace(")", " ").replace(":", " ").replace(".", " ").split())
    keywords = {"def", "return", "self", "if", "for", "in", "import", "class", "None", "not", "is", "raise", "else"}
    indented = any(line.startswith("    ") and line.strip() for line in text.splitlines())
    return bool(words & keywords) and (indented or "(" in text)


# ---- pure pieces -------------------------------------------------------------------------------------------------------
def test_learning_rate_warms_up_then_decays_to_the_floor():
    r = tiny.get_recipe("micro")
    lrs = [tiny.learning_rate(s, r) for s in range(r.steps)]
    assert lrs[0] == pytest.approx(r.lr / (r.warmup_steps + 1))  # models/schedule.py's one warm-up formula
    assert max(lrs) == pytest.approx(r.lr)
    assert tiny.learning_rate(r.steps, r) == pytest.approx(r.lr * r.min_lr_ratio)  # the floor, right after the end
    assert r.lr * r.min_lr_ratio < lrs[-1] < lrs[r.warmup_steps + 1]
    assert all(a <= b for a, b in zip(lrs[:r.warmup_steps], lrs[1:r.warmup_steps]))
    assert all(a >= b for a, b in zip(lrs[r.warmup_steps:], lrs[r.warmup_steps + 1:]))


def test_recipe_checks_and_digest():
    with pytest.raises(ValueError, match="num_layers"):
        tiny.get_recipe("micro", num_layers=3)
    with pytest.raises(ValueError, match="unknown recipe field"):
        tiny.get_recipe("micro", stepz=3)
    with pytest.raises(ValueError, match="unknown tiny verifier recipe"):
        tiny.get_recipe("huge")
    micro = tiny.get_recipe("micro")
    assert micro.digest() == tiny.get_recipe("micro").digest()
    assert micro.digest() != tiny.get_recipe("micro", steps=micro.steps + 1).digest()
    # EAGLE-3's feature layers 2, L//2, L-3 exist in both recipes
    for name in tiny.RECIPES:
        n = tiny.get_recipe(name).num_layers
        assert all(0 <= i < n for i in (2, n // 2, n - 3))


def test_training_batches_are_stream_windows_in_a_seeded_order():
    stream = torch.arange(1000)
    a = list(tiny.training_batches(stream, seq_len=15, batch_size=4, steps=40, seed=3))
    b = list(tiny.training_batches(stream, seq_len=15, batch_size=4, steps=40, seed=3))
    c = list(tiny.training_batches(stream, seq_len=15, batch_size=4, steps=40, seed=4))
    assert len(a) == 40 and all(x.shape == (4, 16) for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    for batch in a:  # every row is a contiguous slice of the stream
        assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(4, 15, dtype=torch.long))
    first_epoch = torch.cat(a[:15])  # 62 windows per epoch: the first 15 batches never repeat a window
    assert len(set(first_epoch[:, 0].tolist())) == len(first_epoch)


def test_eval_windows_predict_every_document_token_once():
    docs = [list(range(10, 10 + n)) for n in (1, 7, 8, 9, 20)]
    inputs, targets = tiny.eval_windows(docs, seq_len=8, eos_id=0)
    assert inputs.shape == targets.shape and inputs.shape[1] == 8
    assert targets[targets != -100].tolist() == [t for d in docs for t in d]
    for inp, tgt in zip(inputs, targets):  # each target is the token after its input (input = previous target)
        valid = tgt != -100
        assert torch.equal(inp[1:][valid[1:]], tgt[:-1][valid[1:]])


def test_bits_per_byte_matches_a_token_by_token_reference(small_tokenizer):
    from transformers import LlamaForCausalLM

    recipe = tiny.get_recipe("micro", **{k: v for k, v in TOY.items() if k != "vocab_size"})
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny.model_config(recipe, small_tokenizer)).eval()
    texts = ["def f(x):\n    return x + 1\n", "import os\nprint(os.sep)  # é\n"]
    got = tiny.bits_per_byte(model, small_tokenizer, texts, seq_len=64, progress=False)
    nats = 0.0
    for text in texts:  # slow reference: each document whole, predicted after <|endoftext|>
        ids = [small_tokenizer.eos_token_id] + small_tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logp = F.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        nats -= sum(logp[i, ids[i + 1]].item() for i in range(len(ids) - 1))
    n_bytes = sum(len(t.encode()) for t in texts)
    assert got["bytes"] == n_bytes
    assert got["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-4)


# ---- tokenizer and chat template ---------------------------------------------------------------------------------------
def test_tokenizer_round_trips_source_and_has_the_special_tokens(small_tokenizer):
    tok = small_tokenizer
    text = read_source(stdlib_files("eval")[0])
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert [tok.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token == tiny.EOS and tok.pad_token == tiny.EOS
    assert tok("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)["input_ids"][0] == 1
    assert tok("x = 1", add_special_tokens=True)["input_ids"] == tok("x = 1", add_special_tokens=False)["input_ids"]


CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sort a list?"},
    {"role": "assistant", "content": "Use sorted(xs)."},
    {"role": "user", "content": "And reversed?"},
    {"role": "assistant", "content": "sorted(xs, reverse=True)\n"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "  You're welcome!"},
]


def test_chat_template_renders_chatml(small_tokenizer):
    text = small_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION)
    prompt = small_tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("Sort a list?<|im_end|>\n<|im_start|>assistant\n")


def test_assistant_mask_is_exactly_the_assistant_content_and_its_end_token(small_tokenizer):
    tok = small_tokenizer
    out = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    runs, current = [], []  # maximal runs of masked tokens
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    assistant = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert len(runs) == len(assistant)
    for run, content in zip(runs, assistant):
        assert run[-1] == tok.convert_tokens_to_ids(tiny.IM_END)
        assert tok.decode(run) == content + tiny.IM_END
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert unmasked.count("<|im_start|>assistant\n") == 3 and "welcome" not in unmasked


def _pythonpath() -> str:
    """The checkout first, then what the caller had (the carried wheels' site on a lent GPU)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


# ---- builds (slow) -----------------------------------------------------------------------------------------------------
def _cli(*args: str, home: Path | None = None, quiet: bool = True) -> subprocess.CompletedProcess:
    """`python -m draftheads.models.tiny ...` in a child process, as users (and `ensure_built`) run it."""
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "HF_HUB_OFFLINE": "1", "DRAFTHEADS_QUIET": "1" if quiet else "0"}
    if home is not None:
        env["DRAFTHEADS_HOME"] = str(home)
    proc = subprocess.run([sys.executable, "-m", "draftheads.models.tiny", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _toy_recipe(**changes) -> tiny.Recipe:
    return tiny.get_recipe("micro", **{**TOY, "name": "tiny-toy", **changes})


def _toy_json(**changes) -> str:
    return json.dumps(dataclasses.asdict(_toy_recipe(**changes)))


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    """`draftheads build-verifier --recipe micro --out DIR`, as a user runs it."""
    out = tmp_path_factory.mktemp("micro") / "tiny-micro"
    proc = _cli("build", "--recipe", "micro", "--out", str(out))
    assert "held-out bits per byte" in proc.stdout and "tokens/s" in proc.stdout
    return out


def test_micro_build_is_an_ordinary_hf_folder_that_writes_python(micro_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", tiny.BUILD_INFO):
        assert (micro_dir / name).is_file(), name
    tok = AutoTokenizer.from_pretrained(micro_dir)
    model = AutoModelForCausalLM.from_pretrained(micro_dir).eval()
    config = AutoConfig.from_pretrained(micro_dir)
    eos = tok.convert_tokens_to_ids(tiny.EOS)
    assert config.model_type == "llama" and config.num_hidden_layers >= 4
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (eos, eos, eos)
    assert model.generation_config.eos_token_id == eos and config.vocab_size == len(tok)
    assert tok.chat_template and "generation" in tok.chat_template

    def greedy(m, prompt):  # the continuation only: the prompt's own keywords must not count
        ids = tok(prompt, return_tensors="pt").input_ids
        out = m.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=eos)
        return tok.decode(out[0, ids.shape[1]:])

    # Prompts end without a space: BPE words carry their leading space, so "def " would end on a lone-space token
    # that the corpus almost never has there.
    prompts = ("def", "    def", "    if", "    return", "import os\n\n\nclass")
    texts = [greedy(model, p) for p in prompts]
    assert sum(looks_like_python(t) for t in texts) >= 3, texts
    # the check can fail: an untrained model of the same shape does not pass it
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(config).eval()
    assert sum(looks_like_python(greedy(untrained, p)) for p in prompts) <= 1


def test_micro_build_loads_as_verifier_with_eagle3_layers(micro_dir, monkeypatch):
    from draftheads.models.verifier import Verifier

    verifier = Verifier.from_pretrained(micro_dir)
    monkeypatch.setenv("DRAFTHEADS_HOME", str(micro_dir.parent))  # where the embedded name finds the same build
    by_name = Verifier.from_pretrained("tiny-micro")
    assert by_name.path == micro_dir and by_name.fingerprint == verifier.fingerprint
    layers = verifier.default_eagle3_layers()
    verifier.check_layer_ids(layers)
    feats = verifier.features(torch.tensor([[0, 5, 6, 7]]), layer_ids=layers, return_logits=True)
    assert feats.logits.shape == (1, 4, verifier.vocab_size)
    info = tiny.read_build_info(micro_dir)
    assert info["recipe_hash"] == tiny.get_recipe("micro").digest()
    assert 0 < info["held_out"]["bits_per_byte"] < 3.2  # an untrained model scores ~3.5 (log2 1024 / 2.85 bytes)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for out, seed in ((a, 0), (b, 0), (c, 1)):
        _cli("build", "--recipe-json", _toy_json(), "--out", str(out), "--seed", str(seed))
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()  # the seed is the model's


def test_build_refuses_to_overwrite_a_foreign_folder(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a tiny verifier build"):
        tiny.build("micro", tmp_path, **TOY)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_ensure_built_uses_the_home_builds_once_and_rebuilds_a_changed_recipe(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_HOME", str(tmp_path / "home"))
    recipe = _toy_recipe()
    folder = tiny.ensure_built(recipe)
    assert folder == tmp_path / "home" / "tiny-toy"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_built(recipe) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == [".tiny-toy.lock", "tiny-toy"]

    changed = _toy_recipe(steps=5)
    assert tiny.ensure_built(changed) == folder
    assert tiny.read_build_info(folder)["recipe_hash"] == changed.digest()
    assert not tiny.is_current(folder, recipe)


def test_concurrent_ensure_built_builds_once(tmp_path):
    """Two processes ask at once: one builds, the other waits and finds the finished folder."""
    code = "import sys, json; from draftheads.models import tiny; print(tiny.ensure_built(tiny.Recipe(**json.loads(sys.argv[1]))))"
    env = {**os.environ, "DRAFTHEADS_HOME": str(tmp_path), "PYTHONPATH": _pythonpath(), "DRAFTHEADS_QUIET": "0"}
    procs = [subprocess.Popen([sys.executable, "-c", code, _toy_json()], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    assert {out.strip() for out, _ in outs} == {str(tmp_path / "tiny-toy")}
    assert sum("building the embedded verifier" in err for _, err in outs) == 1
    assert tiny.is_current(tmp_path / "tiny-toy", _toy_recipe())


def test_path_command_builds_then_prints_only_the_folder(tmp_path):
    for _ in range(2):  # builds, then answers from the cache; logs and bars go to stderr, never into `$(... path)`
        proc = _cli("path", "--recipe-json", _toy_json(), home=tmp_path, quiet=False)
        assert proc.stdout == f"{tmp_path / 'tiny-toy'}\n"
    assert tiny.is_current(tmp_path / "tiny-toy", _toy_recipe())


def test_set_and_device_reach_the_build_and_its_record(tmp_path):
    out = tmp_path / "v"
    proc = _cli("build", "--recipe-json", _toy_json(), "--out", str(out), "--device", "cpu", "--set", "steps=5",
                "--set", "lr=0.004")
    info = tiny.read_build_info(out)
    assert (info["recipe"]["steps"], info["recipe"]["lr"]) == (5, 0.004)
    assert info["recipe_hash"] == _toy_recipe(steps=5, lr=0.004).digest()
    assert info["figures"]["device"] == "cpu" and " threads), final train loss" in proc.stdout


@pytest.mark.cuda
def test_a_build_trains_on_the_gpu_and_saves_a_cpu_folder(tmp_path):
    from draftheads.models.verifier import Verifier

    out = tmp_path / "v"
    proc = _cli("build", "--recipe-json", _toy_json(steps=30), "--out", str(out), "--device", "cuda")
    info = tiny.read_build_info(out)
    assert info["figures"]["device"] == torch.cuda.get_device_name() and info["figures"]["precision"] == "bf16"
    assert f"on {torch.cuda.get_device_name()}" in proc.stdout
    curve = [loss for _, loss in info["figures"]["loss_curve"]]
    assert curve[-1] < curve[0] and math.isfinite(info["held_out"]["bits_per_byte"])
    verifier = Verifier.from_pretrained(out)  # an ordinary folder: loads on the CPU
    assert verifier.device.type == "cpu" and verifier.vocab_size == info["recipe"]["vocab_size"]


def test_stdlib_prompts_are_windows_of_the_split_files(small_tokenizer):
    from tests.utils import script_module

    bench = script_module("bench_gpu")
    prompts = bench.stdlib_prompts(small_tokenizer, "eval", 6, 24, seed=3)
    assert len(prompts) == 6 and all(len(p) == 24 for p in prompts)
    assert prompts == bench.stdlib_prompts(small_tokenizer, "eval", 6, 24, seed=3)  # seeded
    assert prompts != bench.stdlib_prompts(small_tokenizer, "eval", 6, 24, seed=4)
    files = [small_tokenizer.backend_tokenizer.encode(read_source(f), add_special_tokens=False).ids
             for f in stdlib_files("eval")]

    def inside(window, ids):
        return any(ids[i: i + len(window)] == window for i in range(len(ids) - len(window) + 1))

    assert all(any(inside(p, ids) for ids in files) for p in prompts)
    drafter = bench.stdlib_prompts(small_tokenizer, "drafter", 2, 24, seed=3)
    assert not any(inside(drafter[0], ids) for ids in files)  # another split's files
    with pytest.raises(ValueError, match="too few files"):
        bench.stdlib_prompts(small_tokenizer, "eval", 2, 10**6, seed=3)


def test_bench_gpu_fits_and_times_on_the_stdlib_with_an_embedded_build(tmp_path):
    """scripts/bench_gpu.py's realistic settings (gpu_check.sh --realistic) through its CPU dry run: the drafter is
    fitted on the verifier's continuations of drafter-split windows, timed on eval-split windows, tokens exact."""
    from tests.utils import script_module

    folder = tmp_path / "v"
    _cli("build", "--recipe-json", _toy_json(), "--out", str(folder))
    bench = script_module("bench_gpu")
    argv = ["--device", "cpu", "--dry-run", "--embedded", str(folder), "--skip-1b", "--fit-data", "stdlib",
            "--prompt-source", "stdlib", "--fit-batch", "4", "--out", str(tmp_path / "report")]
    assert bench.main(argv) == 0
    [report] = (tmp_path / "report").glob("gpu-*.json")
    res = json.loads(report.read_text())["verifiers"]["embedded"]
    assert res["fit"]["fit_data"] == "stdlib drafter split" and res["fit"]["fit_batch"] == 4
    assert all(v["identical"] for v in res["exactness_fp32"].values())
    assert set(res["timing"]) == {"hf_generate", "autoregressive", "autoregressive_fused", "spec", "spec_fused"}
