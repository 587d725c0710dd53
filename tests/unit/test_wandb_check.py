"""wandb settled before anything loads (eval/measure/wandb_check.py): no API key, a server that does not answer and a
HOME that cannot be written end in one line or a fallback within seconds."""

import time

import pytest

from draftheads.eval.measure.wandb_check import WANDB_DIRS, TrackingError, prepare_wandb

KEY = "a" * 40


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A clean wandb environment (restored afterwards, also what prepare_wandb sets)."""
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", *WANDB_DIRS):
        monkeypatch.setenv(var, "x")
        monkeypatch.delenv(var)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_auto_without_a_key_logs_offline(env, tmp_path):
    assert prepare_wandb("auto", tmp_path, "wandb.mode") == ("offline", [])


def test_online_without_a_key_stops(env, tmp_path):
    with pytest.raises(TrackingError, match=r"wandb\.mode=online but no wandb API key"):
        prepare_wandb("online", tmp_path, "wandb.mode")
    env.setenv("WANDB_MODE", "online")  # asked for through the environment: the message names it
    with pytest.raises(TrackingError, match=r"^WANDB_MODE=online but no wandb API key.*WANDB_MODE=offline, or unset"):
        prepare_wandb("auto", tmp_path, "wandb.mode")


def test_a_server_that_does_not_answer(env, tmp_path):
    env.setenv("WANDB_API_KEY", KEY)
    env.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port: refused at once
    started = time.perf_counter()
    mode, notes = prepare_wandb("auto", tmp_path, "wandb.mode")
    assert mode == "offline" and "127.0.0.1:9 unreachable" in notes[0] and "wandb sync" in notes[0]
    with pytest.raises(TrackingError, match=r"wandb\.mode=online but the wandb server is 127\.0\.0\.1:9 unreachable"):
        prepare_wandb("online", tmp_path, "wandb.mode")
    assert time.perf_counter() - started < 2


def test_a_home_that_cannot_be_written(env, tmp_path):
    env.setenv("HOME", "/proc/nohome")  # cannot be created, even by root
    mode, notes = prepare_wandb("offline", tmp_path / "run", "wandb.mode")
    import os

    assert mode == "offline" and len(notes) == 3
    assert os.environ["WANDB_DATA_DIR"] == str((tmp_path / "run" / "wandb" / "data").resolve())
    env.setenv("WANDB_CACHE_DIR", "/proc/nowhere")  # the user's own choice is not overridden
    with pytest.raises(TrackingError, match=r"WANDB_CACHE_DIR='/proc/nowhere' cannot be written"):
        prepare_wandb("offline", tmp_path / "run", "wandb.mode")
