"""A pilot's size and sample (runtime.pilot); the executor's pilots are tested in test_executor.py."""

from __future__ import annotations

import pytest

from batchllm.core.errors import UserError
from batchllm.runtime.pilot import PilotSize, pilot_rows, wants_pilot


def test_the_default_is_half_a_percent_within_64_and_2000_rows():
    size = PilotSize()
    assert [size.rows_for(n) for n in (50, 1_000, 100_000, 10_000_000)] == [50, 64, 500, 2_000]
    assert not wants_pilot(100, size) and wants_pilot(129, size)  # a pilot is at most half its node


def test_sizes_from_the_command_line():
    assert PilotSize.parse("1%").rows_for(100_000) == 1_000
    assert PilotSize.parse("500").rows_for(100_000) == 500 and PilotSize.parse("500").rows_for(300) == 300
    for bad in ("0", "0%", "60%", "lots", "-3"):
        with pytest.raises(UserError, match=f"--pilot {bad!r} is not a size"):
            PilotSize.parse(bad)


def test_the_sample_is_random_distinct_sorted_and_the_same_for_the_same_seed():
    rows = pilot_rows(10_000, PilotSize(), seed=7)
    assert len(rows) == 64 and len(set(rows.tolist())) == 64 and rows.tolist() == sorted(rows.tolist())
    assert rows.tolist() == pilot_rows(10_000, PilotSize(), seed=7).tolist() != pilot_rows(10_000, PilotSize(), seed=8).tolist()
    assert rows.max() > 5_000  # spread over the data set, not its first rows
