"""Measurement: the harness that times methods side by side, metrics, reports, `tune`, and the checks (train/serve
consistency, the greedy re-check of a results.json)."""
