"""`draftheads build-verifier`'s recipe overrides (`--set`), its `--device` and the code-100m recipe's shape."""

import pytest
import torch

from draftheads.models import tiny
from draftheads.models.tiny.cli import main, recipe_overrides
from draftheads.models.tiny.pretrain import build_device, compute_dtype, model_config


def test_set_reads_json_values_of_the_fields_type():
    r = tiny.get_recipe("micro")
    got = recipe_overrides(r, ["steps=100", "lr=1e-3", "tokenizer_files=null", "precision=fp32",
                               "scaled_residual_init=false", "rope_theta=500000", "name=tiny-x"])
    assert got == {"steps": 100, "lr": 1e-3, "tokenizer_files": None, "precision": "fp32",
                   "scaled_residual_init": False, "rope_theta": 500000, "name": "tiny-x"}
    assert tiny.get_recipe(r, **got).steps == 100


@pytest.mark.parametrize("item, message", [
    ("steps", "expected FIELD=VALUE"),
    ("=3", "expected FIELD=VALUE"),
    ("stepz=3", "no recipe field 'stepz'"),
    ("steps=abc", "field 'steps' takes int (now 300), not 'abc'"),
    ("steps=1.5", "field 'steps' takes int"),
    ("steps=null", "field 'steps' takes int"),
    ("lr=fast", "field 'lr' takes float"),
    ("scaled_residual_init=1", "field 'scaled_residual_init' takes bool"),
    ("precision=3", "field 'precision' takes 'auto' or 'bf16' or 'fp32' (now 'auto'), not 3"),
    ("optimizer=sgd", "field 'optimizer' takes 'adamw' or 'muon'"),
    ("tokenizer_files=all", "field 'tokenizer_files' takes int | None"),
    ("name=", "field 'name' takes str"),
])
def test_set_refuses_a_wrong_field_or_value_naming_both(item, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        recipe_overrides(tiny.get_recipe("micro"), [item])


def test_build_device_takes_cpu_and_refuses_what_torch_cannot_train_on():
    assert build_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="expected cpu or cuda"):
        build_device("tpu")
    with pytest.raises(ValueError, match="expected cpu or cuda"):
        build_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            build_device("cuda")


def test_the_build_autocasts_in_bf16_where_the_device_has_it_unless_the_recipe_says_fp32():
    r = tiny.get_recipe("micro")
    gpu_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    assert compute_dtype(r, "cuda") == (torch.bfloat16 if gpu_bf16 else torch.float32)
    assert compute_dtype(tiny.get_recipe("micro", precision="bf16"), "cuda") == torch.bfloat16
    assert compute_dtype(tiny.get_recipe("micro", precision="fp32"), "cuda") == torch.float32


@pytest.mark.parametrize("argv, message", [
    (["--set", "stepz=3"], "no recipe field 'stepz'"),
    (["--set", "steps=-1"], "warmup_steps=20 must be in [0, steps)"),
    (["--device", "tpu"], "--device 'tpu': expected cpu or cuda[:N]"),
])
def test_cli_says_one_line_and_builds_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "v"
    assert main(["build", "--recipe", "micro", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_changed_recipe_never_lands_in_the_cache(tmp_path, capsys):
    """The cache holds each named recipe as it is (CPU-built, the same bytes for a seed): --set needs --out."""
    assert main(["build", "--recipe", "micro", "--home", str(tmp_path), "--set", "steps=30"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --set builds something other than the cached recipe: give --out DIR\n"
    assert list(tmp_path.iterdir()) == []


def test_code_100m_is_a_100m_llama_with_gqa():
    r = tiny.get_recipe("code-100m")

    class Vocab:  # model_config reads the tokenizer's length and eos id only
        eos_token_id = 0

        def __len__(self):
            return r.vocab_size

    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(model_config(r, Vocab()))
    params = sum(p.numel() for p in model.parameters())
    assert 100e6 < params < 101e6
    assert r.num_kv_heads < r.num_heads and r.hidden_size // r.num_heads == 64
    assert r.steps * r.batch_size * r.seq_len == 13_107_200  # the recipe comment's 13.1M tokens
