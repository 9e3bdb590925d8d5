"""A server's Prometheus `/metrics` page read into one snapshot: load, KV use, preemptions and
the two latency histograms (time to first token, inter-token latency).

Knows vLLM's names (`vllm:*`; the inter-token histogram was `vllm:time_per_output_token_seconds`
before vLLM 0.11, and the KV gauge `vllm:gpu_cache_usage_perc` in the V0 engine) and SGLang's
(`sglang:*`). The text is parsed by `prometheus_client`'s parser only, and samples are looked up
by their sample name (`X_total` of a counter, `X_bucket` of a histogram), so a page with or
without TYPE lines reads the same. Several label sets of one metric (engines of a data-parallel
server, served model names) are summed; KV use is the fullest engine's (a sum of fractions
means nothing).

Invariant: a `Histogram` is cumulative like Prometheus' (`cumulative[i]` observations <=
`upper_bounds_s[i]`, the last bound +Inf), and every operation returns a histogram that is too.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    import httpx


@dataclass(frozen=True)
class Histogram:
    """Observations counted in buckets: `cumulative[i]` of them were <= `upper_bounds_s[i]`."""

    upper_bounds_s: tuple[float, ...]  # strictly ascending, the last is +Inf
    cumulative: tuple[float, ...]  # non-decreasing, one per bound

    def __post_init__(self) -> None:
        bounds, cumulative = self.upper_bounds_s, self.cumulative
        if len(bounds) < 2 or bounds[-1] != math.inf or any(b >= a for a, b in zip(bounds[1:], bounds)):
            raise ValueError(f"upper_bounds_s must be ascending with a finite bound and +Inf last, got {bounds!r}")
        if len(cumulative) != len(bounds):
            raise ValueError(f"cumulative has {len(cumulative)} counts for {len(bounds)} bounds: {cumulative!r}")
        if any(c < 0 or math.isnan(c) for c in cumulative) or any(b < a for a, b in zip(cumulative, cumulative[1:])):
            raise ValueError(f"cumulative must be non-negative and non-decreasing, got {cumulative!r}")

    @classmethod
    def from_bucket_counts(cls, upper_bounds_s: tuple[float, ...], counts: Iterable[float]) -> Histogram:
        """From per-bucket (not cumulative) counts."""
        cumulative, total = [], 0.0
        for count in counts:
            total += count
            cumulative.append(total)
        return cls(upper_bounds_s, tuple(cumulative))

    @property
    def count(self) -> float:
        return self.cumulative[-1]

    def bucket_counts(self) -> list[float]:
        """Observations in each bucket (between the previous bound and this one)."""
        return [c - (self.cumulative[i - 1] if i else 0.0) for i, c in enumerate(self.cumulative)]

    def minus(self, older: Histogram) -> Histogram:
        """The observations made since `older`, bucket by bucket (clamped at 0). When this one holds
        fewer observations than `older`, the server restarted in between (its counters began anew):
        this one is then the observations since the restart."""
        counts = self._counts_since(older)
        return self if counts is None else Histogram.from_bucket_counts(self.upper_bounds_s, counts)

    def count_since(self, older: Histogram) -> float:
        """`self.minus(older).count` without building that histogram (the guard asks it for every pair of
        snapshots it walks, many times a scrape)."""
        counts = self._counts_since(older)
        return self.count if counts is None else sum(counts, 0.0)

    def _counts_since(self, older: Histogram) -> list[float] | None:
        """Per bucket, the observations made since `older` (clamped at 0); None after a restart (this one
        holds fewer observations than `older`: all of its own are since)."""
        if older.upper_bounds_s != self.upper_bounds_s:
            raise ValueError(f"cannot subtract a histogram with bounds {older.upper_bounds_s!r} from one with {self.upper_bounds_s!r}")
        if self.count < older.count:
            return None
        return [max(0.0, new - old) for new, old in zip(self.bucket_counts(), older.bucket_counts())]

    def minus_samples(self, values_s: Sequence[float], copies: int = 1) -> Histogram:
        """Without observations of known values (e.g. the batch's own requests'), each taken `copies` times
        from its bucket. A value whose bucket is already empty is taken from the nearest non-empty bucket
        below, and dropped when there is none: the values are measured by the client, which sees a little
        later than the server, so a value is never taken from above its bucket (though one the client saw
        a bucket later than the server counted it can take a slower observation out of that bucket).
        The values are counted a bucket at a time, lowest first (what is left does not depend on the
        order they are taken in): a minute of the batch's token gaps is thousands of values."""
        if copies < 1:
            raise ValueError(f"copies must be >= 1, got {copies!r}")
        counts = self.bucket_counts()
        ordered, counted = sorted(values_s), 0
        for i, bound in enumerate(self.upper_bounds_s):
            up_to = bisect.bisect_right(ordered, bound)  # values in (previous bound, bound]: Prometheus' `le`
            wanted, counted, j = (up_to - counted) * copies, up_to, i
            while wanted > 0 and j >= 0:
                if counts[j] < 1:
                    j -= 1
                    continue
                taken = min(wanted, math.floor(counts[j]))
                counts[j] -= taken
                wanted -= taken
        return Histogram.from_bucket_counts(self.upper_bounds_s, counts)

    def plus_samples(self, values_s: Sequence[float]) -> Histogram:
        """With more observations of known values, each in its bucket."""
        counts = self.bucket_counts()
        for value in values_s:
            counts[bisect.bisect_left(self.upper_bounds_s, value)] += 1
        return Histogram.from_bucket_counts(self.upper_bounds_s, counts)

    def quantile(self, q: float) -> float | None:
        """The q-quantile as Prometheus' histogram_quantile computes it: linear inside the bucket
        holding rank q * count (from 0 for the first bucket); the last finite bound when that bucket
        is +Inf. None when the histogram is empty."""
        return self._inside_bucket(q, lambda rank, in_bucket: rank / in_bucket)

    def quantile_centred(self, q: float) -> float | None:
        """The q-quantile with the observations of its bucket spread evenly through it, each at the middle
        of its share (the j-th of k at (j - 0.5) / k of the way up), not at its top as `quantile` has
        them: the largest of few observations, one in its bucket, at the bucket's middle, where
        `quantile` puts a p99 of 5 observations 95 % of the way up whatever its value. The last finite
        bound when that bucket is +Inf; None when the histogram is empty."""
        def place(rank: float, in_bucket: float) -> float:
            nearest = max(1.0, math.ceil(rank - 1e-9))  # the nearest rank's place among the bucket's observations
            return min(1.0, (nearest - 0.5) / in_bucket)

        return self._inside_bucket(q, place)

    def _inside_bucket(self, q: float, place: Callable[[float, float], float]) -> float | None:
        """The q-quantile at `place(rank inside its bucket, observations in it)` of the way up that bucket
        (from 0 for the first); the last finite bound when the bucket is +Inf; None when empty."""
        i = self._bucket_of(q)
        if i is None:
            return None
        if i >= len(self.upper_bounds_s) - 1:
            return self.upper_bounds_s[-2]
        lower_s = self.upper_bounds_s[i - 1] if i else 0.0
        below = self.cumulative[i - 1] if i else 0.0
        in_bucket = self.cumulative[i] - below
        if in_bucket <= 0:
            return self.upper_bounds_s[i]
        return lower_s + (self.upper_bounds_s[i] - lower_s) * place(q * self.count - below, in_bucket)

    def quantile_bucket(self, q: float) -> tuple[float, float] | None:
        """The bucket (lower, upper] the q-quantile lies in: all the histogram knows of it (the upper
        bound of the last is +Inf). None when the histogram is empty."""
        i = self._bucket_of(q)
        if i is None:
            return None
        return (self.upper_bounds_s[i - 1] if i else 0.0), self.upper_bounds_s[i]

    def _bucket_of(self, q: float) -> int | None:
        if not 0 <= q <= 1:
            raise ValueError(f"a quantile is in [0, 1], got {q!r}")
        if self.count <= 0:
            return None
        return min(bisect.bisect_left(self.cumulative, q * self.count), len(self.upper_bounds_s) - 1)


@dataclass(frozen=True)
class MetricsSnapshot:
    """What one scrape of a server's metrics showed, summed over its engines. Counters and histograms
    are cumulative since the server started: compare two snapshots for what happened in between."""

    at_s: float  # when it was scraped, on the caller's clock (the clock the guard is driven by)
    server_kind: str  # "vllm" or "sglang"
    running: float  # requests being computed
    waiting: float  # requests queued for a place in the batch
    kv_usage: float | None  # fraction of the KV cache in use, the fullest engine's
    preemptions: float | None  # requests preempted (vLLM) or retracted (SGLang) so far
    generation_tokens: float | None  # tokens generated so far
    ttft: Histogram | None  # time to first token
    itl: Histogram | None  # inter-token latency


@dataclass(frozen=True)
class _Names:
    kind: str
    running: str
    waiting: str
    kv_usage: tuple[str, ...]  # the first one present is used
    preemptions: tuple[str, ...]  # counters, without `_total`
    generation_tokens: str
    ttft: str
    itl: tuple[str, ...]


_SERVERS = (
    _Names("vllm", "vllm:num_requests_running", "vllm:num_requests_waiting",
           ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), ("vllm:num_preemptions",), "vllm:generation_tokens",
           "vllm:time_to_first_token_seconds", ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")),
    _Names("sglang", "sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",),
           ("sglang:num_retracted_requests",), "sglang:generation_tokens",
           "sglang:time_to_first_token_seconds", ("sglang:inter_token_latency_seconds",)),
)


class _Samples:
    """A page's samples by sample name, each a list of (labels, value); NaN values left out."""

    def __init__(self, text: str):
        self.by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not math.isnan(sample.value):
                    self.by_name.setdefault(sample.name, []).append((sample.labels, float(sample.value)))

    def total(self, name: str) -> float | None:
        values = [value for _, value in self.by_name.get(name, [])]
        return sum(values) if values else None

    def largest(self, names: tuple[str, ...]) -> float | None:
        for name in names:
            values = [value for _, value in self.by_name.get(name, [])]
            if values:
                return max(values)
        return None

    def counter(self, names: tuple[str, ...]) -> float | None:
        for name in names:
            value = self.total(f"{name}_total")
            if value is not None:
                return value
        return None

    def histogram(self, names: tuple[str, ...]) -> Histogram | None:
        for name in names:
            buckets = self.by_name.get(f"{name}_bucket", [])
            if not buckets:
                continue
            by_bound: dict[float, float] = {}
            try:
                for labels, value in buckets:
                    bound = float(labels["le"])
                    by_bound[bound] = by_bound.get(bound, 0.0) + value
                bounds = tuple(sorted(by_bound))
                return Histogram(bounds, tuple(by_bound[b] for b in bounds))
            except (KeyError, ValueError):
                return None  # not a histogram this module can read (a bucket without `le`, no +Inf, counts out of order)
        return None


def parse_metrics(text: str, at_s: float) -> MetricsSnapshot | None:
    """The snapshot a `/metrics` page shows; None when the text is not Prometheus' text format or
    shows neither vLLM's nor SGLang's running and waiting counts."""
    try:
        samples = _Samples(text)
    except ValueError:  # what the parser raises for text that is not the exposition format
        return None
    for names in _SERVERS:
        running, waiting = samples.total(names.running), samples.total(names.waiting)
        if running is None or waiting is None:
            continue
        return MetricsSnapshot(
            at_s=at_s, server_kind=names.kind, running=running, waiting=waiting,
            kv_usage=samples.largest(names.kv_usage), preemptions=samples.counter(names.preemptions),
            generation_tokens=samples.counter((names.generation_tokens,)),
            ttft=samples.histogram((names.ttft,)), itl=samples.histogram(names.itl))
    return None


def metrics_url(base_url: str) -> str:
    """The `/metrics` address of a server from its OpenAI base address:
    `http://host:8000/v1` -> `http://host:8000/metrics` (a path before `/v1` is kept)."""
    parts = urlsplit(base_url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"an endpoint's base URL is http(s)://host[:port][/v1], got {base_url!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, f"{path}/metrics", "", ""))


def scrape(client: httpx.Client, url: str, clock: Callable[[], float]) -> MetricsSnapshot | None:
    """One scrape: the snapshot, at `clock()` when the server's answer came back, or None when the
    server cannot be reached, answers other than 200, or shows no metrics this module knows (never
    raises for a network or HTTP error).

    The time is the answer's, not the question's: the page counts what the server had seen when it
    wrote it, and the batch's own first tokens the client saw while the answer was on its way (a
    loaded server on one slow core can take a second) are in its histograms. Stamped when asked,
    those first tokens would fall into the next stretch and stay in this one's count as online
    requests'."""
    import httpx  # the engine layer's HTTP client; only a scrape needs it

    try:
        response = client.get(url)
    except httpx.HTTPError:
        return None
    at_s = clock()
    if response.status_code != 200:
        return None
    return parse_metrics(response.text, at_s)
