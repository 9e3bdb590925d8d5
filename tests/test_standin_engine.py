"""The benchmarks' stand-in engine behind a real worker process (no vLLM, no model)."""

from __future__ import annotations

import time

from batchllm.core.requests import EngineRequest
from batchllm.core.sampling import SamplingSpec
from batchllm.engines.devices import Replica
from batchllm.engines.process_engine import ProcessEngine
from batchllm.engines.protocol import EngineConfig
from benchmarks.standin_engine import MAX_MODEL_LEN, standin_engine, standin_text

CONFIG = EngineConfig(model="standin", replica=Replica("cpu", (0,)))


def collect(engine: ProcessEngine, count: int) -> list:
    results, deadline = [], time.monotonic() + 60
    while len(results) < count and time.monotonic() < deadline:
        results += engine.poll(timeout_s=0.5)
    return results


def test_answers_a_thousand_requests_and_stops_cleanly():
    engine = standin_engine(CONFIG)
    try:
        assert engine.ready.max_num_seqs == 256 and engine.ready.block_size_tokens == 16
        assert engine.ready.kv_capacity_tokens == 1_000_000 and engine.ready.load_time_s == 0.0
        for start in range(0, 1000, 250):
            engine.submit([EngineRequest(f"r{i}", f"question number {i} about topic {i % 7}") for i in range(start, start + 250)])
        results = collect(engine, 1000)
        assert sorted(int(r.request_id[1:]) for r in results) == list(range(1000))
        by_id = {r.request_id: r for r in results}
        assert by_id["r42"].texts == ("ok about topic 0",)
        assert by_id["r42"].num_output_tokens == 4 and by_id["r42"].finish_reason == "stop"
        assert by_id["r42"].num_prompt_tokens == len("question number 42 about topic 0") // 4
        steps = engine.drain_steps()
        assert sum(s.prefill_requests for s in steps) == 1000
        assert len(steps) <= 4  # every request held is answered in the next step
    finally:
        engine.stop()
    assert not engine.is_alive()


def test_counts_token_ids_cuts_at_max_tokens_and_refuses_what_does_not_fit():
    engine = standin_engine(CONFIG)
    try:
        engine.submit([
            EngineRequest("ids", "one two three four", prompt_token_ids=tuple(range(37))),
            EngineRequest("cut", "one two three four", sampling=SamplingSpec(max_tokens=2, n=2)),
            EngineRequest("long", "x" * (4 * MAX_MODEL_LEN)),
        ])
        by_id = {r.request_id: r for r in collect(engine, 3)}
    finally:
        engine.stop()
    assert tuple(by_id["ids"])[:5] == ("ids", ("ok two three four",), 37, 4, "stop")
    assert tuple(by_id["cut"])[:5] == ("cut", ("ok two", "ok two"), 4, 4, "length")
    assert by_id["long"].texts == ("",) and by_id["long"].finish_text().startswith("error: prompt of 4096 tokens")


def test_the_answer_depends_on_the_prompt_alone():
    assert standin_text("a b c d e", 128) == ("ok c d e", "stop")
    assert standin_text("", 128) == ("ok", "stop")
    assert standin_text("a b c", 1) == ("ok", "length")
