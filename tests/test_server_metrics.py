"""A server's /metrics page read into a snapshot: pages written by prometheus_client itself, with
the metric names vLLM 0.32 (and before 0.11) and SGLang register, and the histogram arithmetic
the latency guard relies on."""

from __future__ import annotations

import bisect
import math
import random

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import Histogram as PromHistogram

from batchllm.engines.endpoint.server_metrics import Histogram, metrics_url, parse_metrics, scrape

# vLLM 0.32's default buckets (vllm/v1/metrics/buckets.py), SGLang's defaults (sglang/srt/metrics/collector.py)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                     80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100, 0.200,
                      0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)


def vllm_page(engines: dict[str, dict], *, itl_name: str = "vllm:inter_token_latency_seconds",
              kv_name: str = "vllm:kv_cache_usage_perc") -> str:
    """What a vLLM server's /metrics shows: its metrics as it registers them (labels model_name, engine)."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=registry)
    waiting_by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Waiting requests by reason.", labels + ["reason"],
                              registry=registry)
    kv = Gauge(kv_name, "KV-cache usage. 1 means 100 percent usage.", labels, registry=registry)
    preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=registry)
    generated = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=registry)
    prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=registry)
    ttft = PromHistogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
                         buckets=VLLM_TTFT_BUCKETS, registry=registry)
    itl = PromHistogram(itl_name, "Histogram of inter-token latency in seconds.", labels, buckets=VLLM_ITL_BUCKETS, registry=registry)
    e2e = PromHistogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", labels,
                        buckets=(1.0, 10.0), registry=registry)
    for engine, state in engines.items():
        key = ("Qwen/Qwen2.5-0.5B-Instruct", engine)
        running.labels(*key).set(state["running"])
        waiting.labels(*key).set(state["waiting"])
        waiting_by_reason.labels(*key, "capacity").set(99)  # another metric: not read as `waiting`
        kv.labels(*key).set(state["kv"])
        preemptions.labels(*key).inc(state["preemptions"])
        generated.labels(*key).inc(state["generated"])
        prompt.labels(*key).inc(1000)
        for value in state["ttft"]:
            ttft.labels(*key).observe(value)
            e2e.labels(*key).observe(value * 10)
        for value in state["itl"]:
            itl.labels(*key).observe(value)
    return generate_latest(registry).decode()


def sglang_page(*, running: int, queued: int, token_usage: float, retracted: int, ttft: list[float], itl: list[float]) -> str:
    registry = CollectorRegistry()
    labels = ["model_name"]
    key = ("meta-llama/Llama-3.1-8B-Instruct",)
    Gauge("sglang:num_running_reqs", "The number of running requests.", labels, registry=registry).labels(*key).set(running)
    Gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", labels, registry=registry).labels(*key).set(queued)
    Gauge("sglang:token_usage", "The token usage.", labels, registry=registry).labels(*key).set(token_usage)
    Gauge("sglang:num_retracted_reqs", "The number of retracted requests.", labels, registry=registry).labels(*key).set(1)
    Counter("sglang:num_retracted_requests_total", "Total number of retracted requests.", labels,
            registry=registry).labels(*key).inc(retracted)
    Counter("sglang:generation_tokens_total", "Number of generation tokens processed.", labels,
            registry=registry).labels(*key).inc(321)
    first = PromHistogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
                          buckets=SGLANG_TTFT_BUCKETS, registry=registry)
    gaps = PromHistogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels,
                         buckets=SGLANG_ITL_BUCKETS, registry=registry)
    for value in ttft:
        first.labels(*key).observe(value)
    for value in itl:
        gaps.labels(*key).observe(value)
    return generate_latest(registry).decode()


ONE_ENGINE = {"0": {"running": 3, "waiting": 1, "kv": 0.42, "preemptions": 2, "generated": 500,
                    "ttft": [0.03, 0.03, 0.2, 0.9], "itl": [0.02, 0.02, 0.02, 0.04, 0.3]}}


def test_a_vllm_page():
    snapshot = parse_metrics(vllm_page(ONE_ENGINE), at_s=12.5)
    assert snapshot is not None
    assert (snapshot.at_s, snapshot.server_kind) == (12.5, "vllm")
    assert (snapshot.running, snapshot.waiting, snapshot.kv_usage) == (3, 1, 0.42)
    assert (snapshot.preemptions, snapshot.generation_tokens) == (2, 500)  # counters: `_total` samples
    assert snapshot.ttft is not None and snapshot.itl is not None
    assert snapshot.ttft.upper_bounds_s == (*VLLM_TTFT_BUCKETS, math.inf)
    assert snapshot.ttft.count == 4
    assert snapshot.ttft.cumulative[VLLM_TTFT_BUCKETS.index(0.04)] == 2  # 0.03 twice
    assert snapshot.ttft.cumulative[VLLM_TTFT_BUCKETS.index(0.25)] == 3
    assert snapshot.itl.upper_bounds_s == (*VLLM_ITL_BUCKETS, math.inf)
    assert snapshot.itl.count == 5
    assert snapshot.itl.cumulative[VLLM_ITL_BUCKETS.index(0.025)] == 3


def test_two_engines_are_summed_and_kv_usage_is_the_fullest_engines():
    engines = {"0": ONE_ENGINE["0"],
               "1": {"running": 5, "waiting": 0, "kv": 0.81, "preemptions": 1, "generated": 250, "ttft": [0.5], "itl": [0.02]}}
    snapshot = parse_metrics(vllm_page(engines), at_s=0.0)
    assert snapshot is not None
    assert (snapshot.running, snapshot.waiting, snapshot.kv_usage) == (8, 1, 0.81)
    assert (snapshot.preemptions, snapshot.generation_tokens) == (3, 750)
    assert snapshot.ttft is not None and snapshot.ttft.count == 5
    assert snapshot.ttft.cumulative[VLLM_TTFT_BUCKETS.index(0.5)] == 4
    assert snapshot.itl is not None and snapshot.itl.cumulative[VLLM_ITL_BUCKETS.index(0.025)] == 4


def test_vllm_before_0_11_named_the_inter_token_histogram_and_the_kv_gauge_otherwise():
    text = vllm_page(ONE_ENGINE, itl_name="vllm:time_per_output_token_seconds", kv_name="vllm:gpu_cache_usage_perc")
    assert "vllm:inter_token_latency_seconds" not in text
    snapshot = parse_metrics(text, at_s=0.0)
    assert snapshot is not None
    assert snapshot.itl is not None and snapshot.itl.count == 5
    assert snapshot.kv_usage == 0.42


def test_a_page_without_help_and_type_lines_reads_the_same():
    text = vllm_page(ONE_ENGINE)
    bare = "\n".join(line for line in text.splitlines() if not line.startswith("#")) + "\n"
    assert parse_metrics(bare, at_s=1.0) == parse_metrics(text, at_s=1.0)


def test_an_sglang_page():
    snapshot = parse_metrics(sglang_page(running=7, queued=2, token_usage=0.63, retracted=4, ttft=[0.15, 0.3, 0.3],
                                         itl=[0.009, 0.012]), at_s=3.0)
    assert snapshot is not None
    assert snapshot.server_kind == "sglang"
    assert (snapshot.running, snapshot.waiting, snapshot.kv_usage) == (7, 2, 0.63)
    assert (snapshot.preemptions, snapshot.generation_tokens) == (4, 321)  # the retraction counter, not the gauge
    assert snapshot.ttft is not None and snapshot.ttft.count == 3
    assert snapshot.ttft.cumulative[:3] == (0, 1, 3)
    assert snapshot.itl is not None and snapshot.itl.upper_bounds_s[0] == 0.002 and snapshot.itl.count == 2


@pytest.mark.parametrize("text", [
    "",
    "hello world",
    "<html><body><h1>404 Not Found</h1></body></html>",
    '{"detail": "Not Found"}',
    "# HELP process_cpu_seconds_total CPU time\n# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.5\n",
    "vllm:num_requests_running 3\n",  # running without waiting: not a page this module knows
])
def test_text_without_known_metrics_is_none(text):
    assert parse_metrics(text, at_s=0.0) is None


def test_an_unreadable_histogram_is_left_out_and_the_rest_is_kept():
    text = ("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
            'vllm:time_to_first_token_seconds_bucket{le="0.1"} 4\n'  # no +Inf bucket
            'vllm:inter_token_latency_seconds_bucket{le="0.1"} 4\nvllm:inter_token_latency_seconds_bucket{le="+Inf"} 3\n')
    snapshot = parse_metrics(text, at_s=0.0)
    assert snapshot is not None and snapshot.running == 1
    assert snapshot.ttft is None and snapshot.itl is None


BOUNDS = (0.1, 0.5, 1.0, math.inf)


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    histogram = Histogram(BOUNDS, (10, 20, 20, 20))
    assert histogram.quantile(0.5) == pytest.approx(0.1)  # rank 10: the top of the first bucket
    assert histogram.quantile(0.75) == pytest.approx(0.3)  # rank 15: half-way through (0.1, 0.5]
    assert histogram.quantile(0.25) == pytest.approx(0.05)  # the first bucket starts at 0
    assert histogram.quantile(0.99) == pytest.approx(0.1 + 0.4 * 9.8 / 10)


def test_a_centred_quantile_spreads_its_buckets_observations_evenly_through_it():
    """Five first tokens, the largest alone in (0.1, 0.5]: Prometheus' p99 is 95 % of the way up the
    bucket whatever that token's time; spread evenly, one observation sits at the bucket's middle."""
    few = Histogram(BOUNDS, (4, 5, 5, 5))
    assert few.quantile(0.99) == pytest.approx(0.1 + 0.4 * 0.95)
    assert few.quantile_centred(0.99) == pytest.approx(0.3)
    many = Histogram(BOUNDS, (10, 20, 20, 20))  # rank 19.8: the 10th of 10 in (0.1, 0.5], at 9.5/10 of the way up
    assert many.quantile_centred(0.99) == pytest.approx(0.1 + 0.4 * 0.95)
    assert many.quantile_centred(0.5) == pytest.approx(0.095)  # the 10th of 10 in the first bucket, which starts at 0
    assert Histogram(BOUNDS, (0, 0, 98, 100)).quantile_centred(0.99) == 1.0
    assert Histogram(BOUNDS, (0, 0, 0, 0)).quantile_centred(0.99) is None


def test_quantile_in_the_inf_bucket_is_the_last_finite_bound_and_none_when_empty():
    assert Histogram(BOUNDS, (0, 0, 98, 100)).quantile(0.99) == 1.0
    assert Histogram(BOUNDS, (0, 0, 0, 0)).quantile(0.99) is None
    with pytest.raises(ValueError, match="1.5"):
        Histogram(BOUNDS, (1, 1, 1, 1)).quantile(1.5)


def test_the_bucket_of_a_quantile_is_all_the_histogram_knows_of_it():
    histogram = Histogram(BOUNDS, (10, 20, 20, 20))
    assert histogram.quantile_bucket(0.25) == (0.0, 0.1)
    assert histogram.quantile_bucket(0.5) == (0.0, 0.1)  # rank 10: the top of the first bucket
    assert histogram.quantile_bucket(0.99) == (0.1, 0.5)
    assert Histogram(BOUNDS, (0, 0, 98, 100)).quantile_bucket(0.99) == (1.0, math.inf)
    assert Histogram(BOUNDS, (0, 0, 0, 0)).quantile_bucket(0.99) is None


def test_a_histogram_checks_its_shape_and_quotes_what_is_wrong():
    with pytest.raises(ValueError, match=r"\(0.5, 0.1, inf\)"):
        Histogram((0.5, 0.1, math.inf), (0, 0, 0))
    with pytest.raises(ValueError, match=r"\(3, 2, 2, 2\)"):
        Histogram(BOUNDS, (3, 2, 2, 2))
    with pytest.raises(ValueError, match="2 counts for 4 bounds"):
        Histogram(BOUNDS, (1, 2))


def test_minus_is_what_happened_in_between():
    older = Histogram(BOUNDS, (5, 7, 7, 8))
    newer = Histogram(BOUNDS, (9, 12, 13, 14))
    delta = newer.minus(older)
    assert delta.bucket_counts() == [4, 1, 1, 0]
    assert delta.cumulative == (4, 5, 6, 6)


def test_minus_after_a_server_restart_is_the_newer_histogram():
    older = Histogram(BOUNDS, (50, 70, 70, 80))
    restarted = Histogram(BOUNDS, (2, 3, 3, 3))
    assert restarted.minus(older) == restarted
    with pytest.raises(ValueError, match="bounds"):
        restarted.minus(Histogram((0.2, math.inf), (0, 0)))


def test_minus_samples_takes_known_values_from_their_buckets():
    histogram = Histogram(BOUNDS, (2, 5, 6, 7))  # per bucket: 2, 3, 1, 1
    assert histogram.minus_samples([0.3, 0.3, 5.0]).bucket_counts() == [2, 1, 1, 0]
    assert histogram.minus_samples([0.5]).bucket_counts() == [2, 2, 1, 1]  # `le`: 0.5 is in (0.1, 0.5]


def test_minus_samples_takes_from_the_bucket_below_when_its_own_is_empty_and_never_from_above():
    histogram = Histogram(BOUNDS, (2, 2, 3, 3))  # per bucket: 2, 0, 1, 0
    assert histogram.minus_samples([0.3]).bucket_counts() == [1, 0, 1, 0]  # (0.1, 0.5] is empty: from below
    assert histogram.minus_samples([0.05, 0.05, 0.05]).bucket_counts() == [0, 0, 1, 0]  # the third finds nothing below
    assert histogram.minus_samples([7.0, 7.0, 7.0, 7.0]).bucket_counts() == [0, 0, 0, 0]


def test_minus_samples_copies_take_each_value_that_many_times():
    histogram = Histogram(BOUNDS, (3, 6, 7, 9))  # per bucket: 3, 3, 1, 2
    values = [0.05, 0.3, 0.7, 5.0]
    assert histogram.minus_samples(values, copies=3) == histogram.minus_samples([v for v in values for _ in range(3)])
    assert histogram.minus_samples(values, copies=3).bucket_counts() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="copies must be >= 1, got 0"):
        histogram.minus_samples(values, copies=0)


def _minus_one_at_a_time(histogram: Histogram, values_s: list[float]) -> list[float]:
    """The rule `minus_samples` keeps, a value at a time in the order given."""
    counts = histogram.bucket_counts()
    for value in values_s:
        i = bisect.bisect_left(histogram.upper_bounds_s, value)
        while i >= 0 and counts[i] < 1:
            i -= 1
        if i >= 0:
            counts[i] -= 1
    return counts


def test_minus_samples_counted_a_bucket_at_a_time_leaves_what_taking_them_one_at_a_time_in_any_order_does():
    rng = random.Random(7)
    bounds = (0.01, 0.025, 0.05, 0.1, 0.15, 0.3, 1.0, math.inf)
    for _ in range(3000):
        histogram = Histogram.from_bucket_counts(bounds, [rng.choice([0, 0, 1, 2, 5, 0.5, 1.5]) for _ in bounds])
        values = [rng.choice([0.005, 0.01, 0.02, 0.05, 0.07, 0.1, 0.12, 0.3, 0.9, 4.0]) for _ in range(rng.randint(0, 25))]
        assert histogram.minus_samples(values).bucket_counts() == _minus_one_at_a_time(histogram, values), (histogram, values)


def test_count_since_is_the_count_of_minus_and_the_newer_count_after_a_restart():
    older, newer = Histogram(BOUNDS, (5, 7, 7, 8)), Histogram(BOUNDS, (9, 12, 13, 14))
    assert newer.count_since(older) == newer.minus(older).count == 6
    restarted = Histogram(BOUNDS, (2, 3, 3, 3))
    assert restarted.count_since(older) == restarted.minus(older).count == 3
    with pytest.raises(ValueError, match="bounds"):
        newer.count_since(Histogram((0.2, math.inf), (0, 0)))


def test_metrics_url():
    assert metrics_url("http://host:8000/v1") == "http://host:8000/metrics"
    assert metrics_url("http://host:8000/v1/") == "http://host:8000/metrics"
    assert metrics_url("https://host") == "https://host/metrics"
    assert metrics_url("http://gateway/models/qwen/v1") == "http://gateway/models/qwen/metrics"
    with pytest.raises(ValueError, match="'host:8000/v1'"):
        metrics_url("host:8000/v1")


def test_scrape_reads_a_page_stamped_when_its_answer_came_and_is_none_for_http_errors():
    """The snapshot's time is when the server's answer came back (the clock read after the request),
    not when it was asked: the batch's first tokens seen while the page was on its way are in it."""
    page = vllm_page(ONE_ENGINE)
    clock = iter([4.0, 5.0, 6.0])
    asked: list[float] = []

    def server(request: httpx.Request) -> httpx.Response:
        asked.append(len(asked))
        if request.url.host == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path != "/metrics":
            return httpx.Response(404, text="Not Found")
        return httpx.Response(200, text=page, headers={"content-type": "text/plain; version=0.0.4"})

    with httpx.Client(transport=httpx.MockTransport(server)) as client:
        def answered_at() -> float:
            assert asked, "the clock is read before the server was asked"
            return next(clock)

        snapshot = scrape(client, "http://up:8000/metrics", answered_at)
        assert snapshot is not None and snapshot.at_s == 4.0 and snapshot.running == 3
        assert scrape(client, "http://up:8000/v1/metrics", answered_at) is None
        assert scrape(client, "http://down:8000/metrics", answered_at) is None
