"""Integration tests: in-process runs (a trainer, the engine over a real tiny model), each under 10 s of CPU."""
