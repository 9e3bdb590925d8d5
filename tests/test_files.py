"""Replacing a file or a folder atomically: the new one whole, or the old one untouched."""

from __future__ import annotations

import pytest

from batchllm.core.files import replacing, write_text_atomically


def test_a_file_is_replaced_and_no_temporary_is_left(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")
    with replacing(target) as new:
        assert new.path.parent == tmp_path and new.path.name.endswith(".tmp") and not new.path.exists()
        new.path.write_text("new")
        assert target.read_text() == "old"  # nothing changes before the block ends
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_an_error_leaves_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        with replacing(target) as new:
            new.path.write_text("half")
            raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_keep_old_leaves_the_target_as_it_is(tmp_path):
    target = tmp_path / "t.parquet"
    target.write_text("same")
    before = target.stat().st_mtime_ns
    with replacing(target) as new:
        new.path.write_text("same")
        new.keep_old = True
    assert target.stat().st_mtime_ns == before and sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]


def test_a_folder_replaces_a_folder_with_files(tmp_path):
    target = tmp_path / "profile"
    target.mkdir()
    (target / "stale.csv").write_text("x")
    with replacing(target) as new:
        new.path.mkdir()
        (new.path / "record.json").write_text("{}")
    assert sorted(p.name for p in target.iterdir()) == ["record.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile"]


def test_write_text_atomically(tmp_path):
    write_text_atomically(tmp_path / "a.txt", "é\n")
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "é\n"
