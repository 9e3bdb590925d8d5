"""WhereFilter: one DuckDB connection for every batch of a routed node's rows."""

from __future__ import annotations

import pyarrow as pa
import pytest

from batchllm.core.errors import UserError
from batchllm.io.sql import WhereFilter, where_row_ids


def test_batches_on_one_connection_keep_what_a_fresh_one_keeps():
    check = WhereFilter("gen LIKE '%code' AND n > 1", where="nodes.tech.where")
    batches = [(pa.table({"n": [1, 2, 3], "pos": [10, 11, 12]}), {"gen": pa.array(["a code", "b code", "c food"])}),
               (pa.table({"n": [5, 6], "pos": [13, 14]}), {"gen": pa.array(["code", None])})]
    for rows, upstream in batches:
        expected = where_row_ids(rows, upstream, "gen LIKE '%code' AND n > 1", where="x", key="pos")
        assert check.kept(rows, upstream, key="pos").to_pylist() == expected
    assert [check.kept(rows, upstream, key="pos").to_pylist() for rows, upstream in batches] == [[11], [13]]
    check.close()


def test_a_failing_predicate_names_itself_and_the_filter_still_works_after():
    check = WhereFilter("nope > 1", where="nodes.tech.where")
    with pytest.raises(UserError, match="nope > 1"):
        check.kept(pa.table({"n": [1]}), {}, key="n")
    check.predicate = "n > 1"
    assert check.kept(pa.table({"n": [1, 2]}), {}, key="n").to_pylist() == [2]
