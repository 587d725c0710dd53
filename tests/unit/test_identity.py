"""Identity by content (data/identity.py): a file is hashed once, a stat decides whether to read it again, and what
differs between two records is named file by file."""

import os

import pytest

from draftheads.data.identity import changes, digest, file_record, files_record, input_changes, summarize


def test_a_record_is_size_mtime_and_sha256(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"abc")
    record = file_record(tmp_path / "a.bin")
    assert record["size"] == 3 and record["sha256"].startswith("ba7816bf")  # sha256("abc")
    assert record["mtime_ns"] == os.stat(tmp_path / "a.bin").st_mtime_ns


def test_the_fast_path_trusts_an_unchanged_size_and_mtime(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"one")
    known = file_record(path)
    st = os.stat(path)
    path.write_bytes(b"two")  # same size, then the same mtime back: what `make` and `rsync` would not notice either
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_record(path, known)["sha256"] == known["sha256"]
    os.utime(path)  # the mtime moved: read again, and the new bytes are seen
    assert file_record(path, known)["sha256"] != known["sha256"]


def test_a_touched_file_is_read_again_and_found_the_same(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"same")
    before = files_record(tmp_path, ["w.bin"])
    os.utime(path, ns=(1, 1))
    after = files_record(tmp_path, ["w.bin"], known=before)
    assert after["w.bin"]["mtime_ns"] == 1 and changes(before, after) == [] and digest(before) == digest(after)


def test_changes_name_each_file(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).write_text(name)
    old = files_record(tmp_path, ["a", "b"])
    (tmp_path / "a").write_text("A")
    (tmp_path / "c").write_text("c")
    new = files_record(tmp_path, ["a", "c"])
    phrases = changes(old, new)
    assert phrases[0].startswith("a changed (sha256 ") and phrases[1:] == ["b removed", "c added"]
    assert summarize(phrases, limit=1) == f"{phrases[0]} and 2 more"


def test_the_digest_is_contents_and_names_not_times_or_places(tmp_path):
    for folder in ("x", "y"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "m.bin").write_bytes(b"weights")
        (tmp_path / folder / "t.json").write_text("{}")
    x, y = (files_record(tmp_path / f, ["m.bin", "t.json"]) for f in ("x", "y"))
    assert digest(x) == digest(y)  # another folder, other mtimes: the same contents
    os.rename(tmp_path / "y" / "t.json", tmp_path / "y" / "u.json")
    assert digest(files_record(tmp_path / "y", ["m.bin", "u.json"])) != digest(x)  # names order a folder's files
    one = files_record(tmp_path / "x", ["m.bin"])
    renamed = {"other.bin": one["m.bin"]}
    assert digest(one) == digest(renamed) and changes(one, renamed) == []  # a single file: its name is not content


def test_input_changes_name_the_input_and_the_file():
    def files(sha):
        return {"model.safetensors": {"size": 1, "mtime_ns": 0, "sha256": sha * 64}}

    old = {"verifier": {"source": "v", "files": files("a"), "digest": "1"},
           "data": {"source": "hf:x", "files": {}, "digest": "hub:hf:x"}}
    new = {"verifier": {"source": "w", "files": files("b"), "digest": "2"},
           "data": {"source": "hf:y", "files": {}, "digest": "hub:hf:y"}}
    assert input_changes(old, new) == ["the verifier: model.safetensors changed (sha256 aaaaaaaa -> bbbbbbbb)",
                                       "data.source: 'hf:x' -> 'hf:y'"]
    assert input_changes(old, {**old, "feature_cache": new["verifier"]}) == ["the feature cache added"]


def test_a_large_file_is_hashed_once_per_machine(tmp_path, monkeypatch):
    """Its hash is kept in $DRAFTHEADS_HOME/sha256.json: another process (here: the memo emptied) reads the file no
    more, while a file changed since (another mtime) is read again."""
    import draftheads.data.identity as identity

    monkeypatch.setenv("DRAFTHEADS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(identity, "DISK_MEMO_MIN_BYTES", 4)
    monkeypatch.setattr(identity, "_MEMO", {})
    monkeypatch.setattr(identity, "_DISK_LOADED", False)
    path = tmp_path / "big.bin"
    path.write_bytes(b"x" * 100)
    first = file_record(path)
    assert (tmp_path / "home" / "sha256.json").is_file()
    monkeypatch.setattr(identity, "_MEMO", {})
    monkeypatch.setattr(identity, "_DISK_LOADED", False)
    monkeypatch.setattr(identity, "sha256_file", lambda p: (_ for _ in ()).throw(AssertionError("read again")))
    assert file_record(path) == first
    path.write_bytes(b"y" * 100)
    os.utime(path, ns=(5, 5))
    monkeypatch.undo()
    assert file_record(path)["sha256"] != first["sha256"]


def test_a_home_that_cannot_be_written_costs_nothing_but_time(tmp_path, monkeypatch):
    import draftheads.data.identity as identity

    monkeypatch.setenv("DRAFTHEADS_HOME", "/proc/nohome")
    monkeypatch.setattr(identity, "DISK_MEMO_MIN_BYTES", 4)
    (tmp_path / "big.bin").write_bytes(b"z" * 100)
    assert file_record(tmp_path / "big.bin")["size"] == 100


def test_recheck_refuses_a_medusa2_folder_replaced_since_the_run(tmp_path):
    """A Medusa-2 run's adapter is part of the verifier it decoded with: re-checking after the drafter folder was
    replaced by another training would merge the other adapter and blame the outputs; the digest results.json
    recorded is compared first, and the refusal names both."""
    from draftheads.data.identity import folder_digest
    from draftheads.eval.measure.recheck import load_run_verifier
    from draftheads.models.verifier import VerifierError
    from tests.utils import save_tiny_verifier

    verifier = save_tiny_verifier(tmp_path / "v")
    drafter = tmp_path / "medusa2" / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    recorded = folder_digest(drafter)
    (drafter / "config.json").write_text('{"replaced": true}')
    results = {"config": {"verifier": str(verifier), "methods": [
        {"method": "medusa", "draft": str(drafter), "draft_digest": recorded}]}}
    with pytest.raises(VerifierError, match=f"had content digest {recorded}, .* has {folder_digest(drafter)}"):
        load_run_verifier(results)
