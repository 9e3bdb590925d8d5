"""`batchllm store info | prune` over a result store (`io/result_store.py`): exact outputs, and
exit 2 naming what is wrong for a bad value or a file that is not a store."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from batchllm.cli import app
from batchllm.io.result_store import ResultStore
from tests.test_result_store import RUN, SCOPE, Clock, key, text_record


@pytest.fixture
def path(tmp_path):
    return tmp_path / "store" / "results.sqlite"


def store_cli(*args: object):
    return CliRunner().invoke(app, ["store", *map(str, args)])


def test_store_info_of_the_home_store(isolated_home, monkeypatch):
    monkeypatch.delenv("BATCHLLM_STORE")  # the home's store, as a user without the variable has it
    assert store_cli("info").output == f"store: {isolated_home / 'results.sqlite'}\nempty: no run has stored results there yet\n"
    clock = Clock()
    with ResultStore.at_home(isolated_home) as store:
        store._clock = clock
        store.put_many([(key(k), SCOPE, text_record("x" * 1000)) for k in range(3)], RUN)
        clock.now += 86_400
        store.put_many([(key("late"), SCOPE, text_record("y"))], RUN)
    result = store_cli("info")
    assert result.exit_code == 0
    assert result.output == (f"store: {isolated_home / 'results.sqlite'}\n"
                             "entries: 4\n"
                             "size: 3.4 KiB of 10.0 GiB\n"
                             "damaged entries set aside: 0\n"
                             "oldest use: 2026-12-07 19:00 UTC\n"
                             "newest use: 2026-12-08 19:00 UTC\n")


def test_store_prune_by_size_and_age(path):
    with ResultStore(path) as store:
        store.put_many([(key(k), SCOPE, text_record("x" * 1000)) for k in range(5)], RUN)
    result = store_cli("prune", "--store", path, "--max-size", "2.5KB")
    assert result.exit_code == 0
    assert result.output == f"removed 3 entries (3.3 KiB)\nstore: {path}: 2 entries, 2.2 KiB of 10.0 GiB\n"
    assert store_cli("prune", "--store", path, "--older-than", "0").output == (
        f"removed 2 entries (2.2 KiB)\nstore: {path}: 0 entries, 0 B of 10.0 GiB\n")


@pytest.mark.parametrize("args, message", [
    (["--max-size", "lots"], "error: --max-size: 'lots' is not a size. Fix: write a number of bytes with a unit, e.g. 500MB, 2GB "
                             "or 1.5GiB.\n"),
    (["--older-than", "-1"], "error: --older-than: -1.0 is not a number of days. Fix: give 0 or more, e.g. 30.\n"),
])
def test_store_prune_bad_values_exit_2(path, args, message):
    ResultStore(path).close()
    result = store_cli("prune", "--store", path, *args)
    assert (result.exit_code, result.output) == (2, message)


def test_store_info_of_a_file_that_is_not_a_store_exits_2_naming_it(tmp_path):
    bad = tmp_path / "results.sqlite"
    bad.write_text("hello")
    result = store_cli("info", "--store", bad)
    assert result.exit_code == 2 and f"error: {bad}: the result store is not a SQLite database" in result.output
