"""scripts/bench_scale.py's pure pieces: the ladder's prediction, a child's report into a row, the table."""

import pytest

from tests.e2e.test_bench_scale import bench_module

GIB = 2**30


def test_prediction_is_linear_through_the_last_two_rungs():
    bench = bench_module()
    assert bench.predict_gib([], 2048) is None
    rows = [{"seq": 1024, "peak_gib": 12.0, "static_gib": 6.0}, {"seq": 2048, "peak_gib": 16.0, "static_gib": 6.0}]
    assert bench.predict_gib(rows, 4096) == pytest.approx(24.0)
    # one rung: what is not static (nor the process's baseline) taken to grow with the tokens
    one = [{"seq": 1024, "peak_gib": 12.0, "static_gib": 6.0, "baseline_gib": 1.0}]
    assert bench.predict_gib(one, 2048) == pytest.approx(7.0 + 5.0 * 2)
    # rows that did not fit carry no peak and predict nothing
    assert bench.predict_gib([{"seq": 1024, "status": "did not fit"}], 2048) is None


def test_a_report_becomes_a_row_and_a_failure_stays_one_line():
    bench = bench_module()
    report = {"tokens_per_step": 1024, "seconds_per_step": 32.0, "cpu_seconds_per_step": 60.0,
              "peak_rss_mib": 12 * 1024, "baseline_rss_mib": 512, "weights_bytes": 3 * GIB, "grads_bytes": 1 * GIB,
              "optimizer_bytes": 2 * GIB, "static_bytes": 6 * GIB, "trainable_params": 268435456}
    row = bench.summarize(report, "cpu")
    assert row["status"] == "ok" and row["peak_gib"] == 12 and row["static_gib"] == 6 and row["rest_gib"] == 6
    assert row["rest_mib_per_token"] == 6.0 and row["tokens_per_s"] == 32.0 and row["baseline_gib"] == 0.5
    failed = bench.summarize({"error": "did not fit: killed at 20.3 GiB RSS (--memory-gib 20)", "did_not_fit": True,
                              "peak_rss_mib": 20.3 * 1024}, "cpu")
    assert failed["status"] == "did not fit" and "peak_gib" not in failed
    settings = {"device": "cpu", "tiny": False, "threads": 2, "warmup": 1, "steps": 2, "torch": "x",
                "precision_note": "bf16", "cpu": "a CPU"}
    rows = [{"trainer": "eagle3", "label": "EAGLE-3", "model": "llama3-8b", "features": "online", "seq": 1024, **row},
            {"trainer": "eagle3", "label": "EAGLE-3", "model": "llama3-8b", "features": "online", "seq": 2048,
             **failed}]
    table = bench.markdown({"settings": settings, "command": "python scripts/bench_scale.py", "rows": rows})
    lines = [x for x in table.splitlines() if x.startswith("| EAGLE-3")]
    assert lines[0].startswith("| EAGLE-3 | llama3-8b | online | 1024 | 12.00 | 6.00 (3.00 + 1.00 + 2.00) | 6.00 |")
    assert "did not fit: killed at 20.3 GiB RSS" in lines[1] and lines[1].count("|") == lines[0].count("|")


def test_static_memory_counts_frozen_parameters_as_weights_only():
    """A peer may hand its optimizer a frozen parameter (speculators: the embedding): weights, not gradients or
    state."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("scale_meter", bench_module().ROOT / "scripts" / "scale_meter.py")
    meter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(meter)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))
    model[0].weight.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    split = meter.memory_split([model, model[1]], [optimizer])  # shared tensors counted once
    assert split["weights_bytes"] == 4 * (40 + 15) and split["grads_bytes"] == 4 * 15
    assert split["trainable_params"] == 15
    assert split["optimizer_bytes"] == 2 * 4 * 15 + 2 * 4  # two moments, and a step count per tensor
    assert split["static_bytes"] == split["weights_bytes"] + split["grads_bytes"] + split["optimizer_bytes"]
    # on a GPU only what the device holds counts (a verifier embedding kept in host memory does not)
    assert meter.memory_split([model, model[1]], [optimizer], "cpu") == split
    elsewhere = meter.memory_split([model, model[1]], [optimizer], "cuda")
    assert elsewhere["static_bytes"] == 0 and elsewhere["trainable_params"] == 15


def test_anchors_reach_our_dflash_and_speculators_alike(tmp_path, monkeypatch):
    bench = bench_module()
    monkeypatch.setattr(bench, "speculators_data", lambda *a: tmp_path / "data")  # the flags only, no features
    ours = bench.TRAINERS["dflash-1layer"]
    standin = tmp_path / "standin"
    flags = bench.our_flags(ours, "qwen3-8b", 1024, "offline", standin, None, False, "bf16", tmp_path,
                            anchors=128)
    assert "--dflash.num_anchors=128" in flags
    assert not any("num_anchors" in f for f in bench.our_flags(ours, "qwen3-8b", 1024, "offline", standin, None,
                                                               False, "bf16", tmp_path))  # the config's 512
    standin.mkdir()
    (standin / "config.json").write_text('{"hidden_size": 64, "vocab_size": 128, "num_attention_heads": 4}')
    spec = bench.peer_spec("speculators-dflash", "qwen3-8b", 1024, 2, standin, False, tmp_path, "cpu", tmp_path / "r",
                           1, anchors=128)
    flags = spec["flags"]
    assert flags[flags.index("--max-anchors") + 1] == "128"
    with pytest.raises(SystemExit):
        bench.parse(["--anchors", "0"])
