"""scripts/bench_scale.py --tiny: one trainer, one seq, the whole pipeline (stand-in, feature cache, a measuring
child, JSON and table), then --reuse keeping the row without measuring again."""

import json

from tests.utils import script_module


def bench_module():
    return script_module("bench_scale")


def test_tiny_bench_writes_a_row_and_reuses_it(tmp_path):
    bench = bench_module()
    argv = ["--tiny", "--trainers", "eagle3", "--models", "llama3-8b", "--features", "offline", "--seqs", "64",
            "--steps", "1", "--threads", "1", "--memory-gib", "4", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "scale-cpu-tiny.json").read_text())
    assert doc["settings"]["tiny"] and doc["settings"]["device"] == "cpu" and doc["settings"]["steps"] == 1
    [row] = doc["rows"]
    assert row["status"] == "ok", row
    assert (row["trainer"], row["model"], row["features"], row["seq"]) == ("eagle3", "llama3-8b", "offline", 64)
    assert row["tokens_per_step"] == 64 and row["steps_measured"] == 1 and row["threads"] == 1
    assert 0 < row["static_gib"] < row["peak_gib"] < 4
    assert abs(row["static_gib"] - (row["weights_gib"] + row["grads_gib"] + row["optimizer_gib"])) < 1e-9
    # AdamW: two fp32 moments per fp32 parameter (and a step count per tensor)
    assert 0 <= row["optimizer_gib"] - 2 * row["grads_gib"] < 1 / 1024
    assert abs(row["rest_gib"] - (row["peak_gib"] - row["static_gib"])) < 1e-9
    assert abs(row["rest_mib_per_token"] - row["rest_gib"] * 1024 / 64) < 1e-9
    assert abs(row["tokens_per_s"] - 64 / row["seconds_per_step"]) < 1e-6
    assert abs(row["tokens_per_cpu_s"] - 64 / row["cpu_seconds_per_step"]) < 1e-6
    assert row["trainable_params"] > 0
    table = (tmp_path / "scale-cpu-tiny.md").read_text()
    line = next(x for x in table.splitlines() if x.startswith("| EAGLE-3 | llama3-8b | offline | 64 |"))
    assert f"{row['peak_gib']:.2f}" in line and f"{row['trainable_params'] / 1e6:.1f}M" in line
    assert "    python scripts/bench_scale.py --tiny" in table

    # --reuse: the row is kept as measured (no child runs: its numbers are the same to the last digit)
    assert bench.main(argv + ["--reuse"]) == 0
    again = json.loads((tmp_path / "scale-cpu-tiny.json").read_text())
    assert again["rows"] == doc["rows"]
