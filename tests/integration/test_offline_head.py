"""An offline run (`features: offline`) holds only the verifier's head (embedding, lm_head, final norm: no decoder
layer) and trains exactly as it did with the whole verifier loaded, on the same cache; the end-of-run train/serve
check, which runs the verifier, loads it whole for that moment."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftheads.models.verifier import Verifier
from draftheads.train.config import parse_config
from tests.utils import save_tiny_verifier_with_tokenizer, tiny_eagle3_args

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_accelerate")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def eagle3_args(verifier_dir, source, output_dir, *extra):
    return tiny_eagle3_args(verifier_dir, source, output_dir, "--consistency.num_prompts=1",
                            "--consistency.max_new_tokens=6", *extra, seq_len=24, draft_vocab_size=100)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def dumped_cache(tmp_path):
    """(verifier folder, rows file, feature cache) of a tiny verifier, 8 rows and an EAGLE-3 dump of them."""
    from draftheads.train.dump_features import dump
    from draftheads.train.eagle import EagleRunConfig

    verifier_dir = save_tiny_verifier_with_tokenizer(tmp_path / "v")
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 3}) + "\n"
                              for i in range(8)))
    cache = tmp_path / "cache"
    dump(parse_config(EagleRunConfig, eagle3_args(verifier_dir, source, tmp_path / "unused")), cache,
         dtype="float32", say=lambda *a, **k: None)
    return verifier_dir, source, cache


def loaded_verifiers(monkeypatch, trainer) -> list:
    """Every (verifier, tokenizer) the trainer module's load_verifier returns from now on, in order."""
    loaded = []
    load_verifier = trainer.load_verifier
    monkeypatch.setattr(trainer, "load_verifier", lambda *a, **k: loaded.append(load_verifier(*a, **k)) or loaded[-1])
    return loaded


def test_offline_run_holds_no_layer_and_trains_as_with_the_whole_verifier(tmp_path, monkeypatch):
    from draftheads.train import eagle as train_eagle
    from draftheads.train.eagle import EagleRunConfig

    verifier_dir, source, cache = dumped_cache(tmp_path)
    offline = ("--features=offline", f"--feature_cache={cache}")

    loaded = loaded_verifiers(monkeypatch, train_eagle)
    train_eagle.main(parse_config(EagleRunConfig, eagle3_args(verifier_dir, source, tmp_path / "head", *offline)))
    verifier = loaded[0][0]
    assert verifier.head_only and json.loads((cache / "index.json").read_text())["argmax"]
    on_device = {n for n, p in verifier.model.named_parameters() if p.device.type != "meta"}
    assert on_device == {"model.embed_tokens.weight", "model.norm.weight"}  # lm_head: its draft rows only
    H, V = verifier.hidden_size, verifier.vocab_size
    assert verifier.held_bytes() == 4 * (V * H + 100 * H + H)  # fp32: embedding, 100 draft rows, norm; no layer

    # The path before: the whole verifier loaded for an offline run.
    def whole(cls, name, dtype=None, device=None, trust_remote_code=False, layers=(), embedding_device=None):
        return cls.from_pretrained(name, dtype=dtype, device=device, trust_remote_code=trust_remote_code)

    monkeypatch.setattr(Verifier, "load_head", classmethod(whole))
    train_eagle.main(parse_config(EagleRunConfig, eagle3_args(verifier_dir, source, tmp_path / "whole", *offline)))
    assert not loaded[1][0].head_only and loaded[1][0].held_bytes() > 2 * verifier.held_bytes()

    head_run, whole_run = metrics(tmp_path / "head"), metrics(tmp_path / "whole")
    assert "eval/tau" in head_run[-1]  # the train/serve check ran: on the whole verifier, loaded for it
    assert len(head_run) == len(whole_run)
    for a, b in zip(head_run, whole_run):
        assert a.keys() == b.keys()
        for key in a:
            if "loss" in key or "acc" in key or key in ("eval/tau", "eval/tau_in_memory"):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key
    for key, value in load_file(tmp_path / "whole" / "drafter" / "model.safetensors").items():
        assert torch.equal(load_file(tmp_path / "head" / "drafter" / "model.safetensors")[key], value), key
    exported = [json.loads((tmp_path / run / "drafter" / "config.json").read_text())["draftheads"]["verifier"]
                for run in ("head", "whole")]
    assert exported[0] == exported[1] and exported[0]["fingerprint"] == verifier.fingerprint


@pytest.mark.cuda
def test_offline_run_on_a_gpu_keeps_the_embedding_in_host_memory_cuda(tmp_path, monkeypatch):
    """verifier_embedding=host (auto's choice on a GPU) against device: the table stays in host memory, the losses
    are the same."""
    from draftheads.train import eagle as train_eagle
    from draftheads.train.eagle import EagleRunConfig

    verifier_dir, source, cache = dumped_cache(tmp_path)
    loaded = loaded_verifiers(monkeypatch, train_eagle)
    for where in ("host", "device"):
        train_eagle.main(parse_config(EagleRunConfig, eagle3_args(
            verifier_dir, source, tmp_path / where, "--features=offline", f"--feature_cache={cache}",
            f"--verifier_embedding={where}", "--consistency.enabled=false")))
    host, device = (run[0] for run in loaded)
    assert host.embedding_held_apart and host.embed_tokens.weight.device.type == "cpu"
    assert not device.embedding_held_apart and host.device == device.device == device.embed_tokens.weight.device
    a, b = metrics(tmp_path / "host"), metrics(tmp_path / "device")
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        for key in x:
            if "loss" in key or "acc" in key:
                assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), key
