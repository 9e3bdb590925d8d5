"""What the latency guard aims at and what it shows: the p99 targets, each with the band the batch
aims inside (it may grow under the band, and eases off over it), and a reading for progress and
status.

Invariant: a target is None only when it has no bound (an SLO without it, or a baseline that saw
no observation of it), and then so is its band; growth bound <= ease bound <= target.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchllm.core.latency_slo import BASELINE_MARGIN, LatencySlo
from batchllm.engines.endpoint.latency_window import WindowLatency

SERVER_METRICS = "server metrics"
OWN_REQUESTS = "own requests"


@dataclass(frozen=True)
class GuardReading:
    """The guard's state for progress and status. The p99s are the online traffic's as the guard
    reads them (basis "server metrics"; inter-token from the batch's own gaps beside online
    requests) or the batch's own (basis "own requests"), over the last window."""

    allowed: int
    online_ttft_p99_s: float | None
    online_itl_p99_s: float | None
    ttft_target_s: float | None
    itl_target_s: float | None
    basis: str  # "server metrics" or "own requests"
    phase: str  # a GuardPhase's value: "measuring baseline", "waiting", "held back", "slow start", "guarding", "draining a cut"
    why: str | None = None  # waiting or held back: why the batch waits; guarding: why it did not grow at the last decision

    def describe(self) -> str:
        """`in flight <= 12; online p99 TTFT 0.21 s (target 0.25), inter-token 31 ms (target 40)`, the
        phase in front unless it is plain guarding."""
        text = f"in flight <= {self.allowed}; {self.latencies()}"
        if self.phase == "waiting":
            return f"waiting ({self.why}; 1 in flight only in a quiet stretch without online requests); {text}"
        if self.phase == "held back":
            return f"held back ({self.why}; none in flight until a lull, a lighter load or a try beside them); {text}"
        if self.phase in ("guarding", "slow start"):
            return text if self.why is None else f"in flight <= {self.allowed} (not growing: {self.why}); {self.latencies()}"
        return f"{self.phase}; {text}"

    def latencies(self) -> str:
        """`online p99 TTFT 0.21 s (target 0.25), inter-token 31 ms (target 40)`."""
        def target(value: float | None, scale: float, digits: int) -> str:
            if self.phase == "measuring baseline" and self.ttft_target_s is None and self.itl_target_s is None:
                return ""
            return " (no target)" if value is None else f" (target {value * scale:.{digits}f})"

        ttft = "unknown" if self.online_ttft_p99_s is None else f"{self.online_ttft_p99_s:.2f} s"
        itl = "unknown" if self.online_itl_p99_s is None else f"{self.online_itl_p99_s * 1000:.0f} ms"
        who = "online" if self.basis == SERVER_METRICS else "own"
        return f"{who} p99 TTFT {ttft}{target(self.ttft_target_s, 1, 2)}, inter-token {itl}{target(self.itl_target_s, 1000, 0)}"


@dataclass(frozen=True)
class GuardChange:
    """One change of the guard's phase or allowance and what it read then: a line of its log, so that
    why the batch ran as it did can be read after the run."""

    at_s: float  # the guard's clock
    allowed_before: int
    reading: GuardReading  # after the change
    verdict: str | None  # the verdict that made it (a Verdict's value); None: a phase's own rule (baseline, waiting, held back, draining)
    in_flight: int  # the batch's requests on the server then
    online_on_server: float | None  # requests on the server that were not the batch's, in the newest scrape (None: no fresh scrape)
    held_by: tuple[tuple[str, int], ...] = ()  # why the decisions since the change before held the level, with how many did, most first
    because: str | None = None  # what in the evidence gave the verdict (a cut's excess, ...), in words

    def describe(self) -> str:
        """`slow start: in flight <= 1 -> 2 (grow); on the server 1 batch, 0 online; online p99 TTFT 0.21 s
        (target 0.25), inter-token 31 ms (target 40)`, what gave the verdict after it where it says (`(cut:
        online p99 TTFT 0.31 s over its target 0.25 s)`), why it waits after the phase where it does, and
        why the decisions since the change before held the level, with how many did (`; held before:
        online requests on the server rising x12, too few online observations x3`)."""
        r = self.reading
        because = ""
        if self.verdict:
            because = f" ({self.verdict}: {self.because})" if self.because else f" ({self.verdict})"
        why = f" ({r.why})" if r.why and r.phase in ("waiting", "held back") else ""
        online = "unknown" if self.online_on_server is None else f"{self.online_on_server:g}"
        held = ", ".join(f"{reason} x{count}" for reason, count in self.held_by)
        held = f"; held before: {held}" if held else ""
        return (f"{r.phase}{why}: in flight <= {self.allowed_before} -> {r.allowed}{because}; on the server {self.in_flight} batch, "
                f"{online} online; {r.latencies()}{held}")


@dataclass(frozen=True)
class GuardTargets:
    """The p99 targets, the p99s under which the batch may grow and those over which it eases off
    (None: no bound)."""

    ttft_target_s: float | None
    itl_target_s: float | None
    ttft_grow_under_s: float | None
    itl_grow_under_s: float | None
    ttft_ease_over_s: float | None
    itl_ease_over_s: float | None

    def __post_init__(self) -> None:
        for target, grow, ease in ((self.ttft_target_s, self.ttft_grow_under_s, self.ttft_ease_over_s),
                                   (self.itl_target_s, self.itl_grow_under_s, self.itl_ease_over_s)):
            if target is None:
                if grow is not None or ease is not None:
                    raise ValueError(f"a latency without a target has no band, got {grow!r} and {ease!r}")
            elif grow is None or ease is None or not 0 <= grow <= ease <= target:
                raise ValueError(f"need 0 <= growth bound <= ease bound <= target, got {grow!r}, {ease!r}, {target!r}")

    def lets_grow(self, latency: WindowLatency) -> bool:
        """Each p99 with a bound is known and under its growth bound (interpolated in its histogram
        bucket where that is all there is: stop 37 let a bucket that merely held the growth bound
        count as under it, and growth on a p99 interpolated over the bound is growth without evidence).
        A first-token p99 in a wide bucket (its top `WIDE_BUCKET` x its bottom or more) wholly under the
        target also counts once it is under the growth bound with the bucket's observations spread
        evenly through it (`ttft_p99_centred_s`): the evidence then is that the level kept the target
        for sure, and where in its bucket the p99 most likely is. In a narrow bucket the interpolation
        errs by little, and the batch's first tokens, seen by its client later than the server counted
        them, take slower online ones out of the histogram (`latency_window`): with 150 ms of client
        time in each, a level grown on a centred p99 in the 60-80 ms bucket left a scripted heavy
        load's window at 1.33x alone's first-token p99. Interpolated as Prometheus does, the p99 of a window's few first tokens sits
        near the top of the bucket its largest lies in, and vLLM's bucket from 0.1 to 0.25 s holds
        light loads' slowest first tokens: one such token read as 0.24 s against a growth bound of
        0.22 s (target 0.29 s) and held the batch at 1 through coserve (a)'s light phase, 17 scrapes
        in 33 s, where the clients' first-token p99 alone was 0.19 s (AVX-512 host, 2026-11-29).
        An inter-token p99 counts only when all that is known of it is under its growth bound: its
        histogram bucket's top (at 0 in flight), or beside the batch's own requests the p99 of their gaps at
        the most their noise allows (`latency_window.weighted_p99_at_most`). Grown on their nearest-rank
        p99s, 61 and 58 ms against a 64 ms bound, at the start of coserve (a)'s heavy phase, the batch left
        that window at 1.29x alone's inter-token p99 (a host no matrix had run on, 2026-11-30)."""
        return self._ttft_lets_grow(latency) and _surely_under(latency.itl_p99_s, latency.itl_p99_bucket_s, self.itl_grow_under_s)

    def _ttft_lets_grow(self, latency: WindowLatency) -> bool:
        if _under(latency.ttft_p99_s, self.ttft_grow_under_s):
            return True
        bucket, centred = latency.ttft_p99_bucket_s, latency.ttft_p99_centred_s
        return (bucket is not None and self.ttft_target_s is not None and bucket[1] <= self.ttft_target_s
                and bucket[1] >= WIDE_BUCKET * bucket[0] and _under(centred, self.ttft_grow_under_s))

    @classmethod
    def from_slo(cls, slo: LatencySlo, grow_below: float, ease_above: float) -> GuardTargets:
        """The band as shares of each target: grow under `grow_below` x target, ease off over `ease_above` x target."""
        def share(p99_s: float | None, factor: float) -> float | None:
            return None if p99_s is None else factor * p99_s

        return cls(slo.ttft_p99_s, slo.itl_p99_s, share(slo.ttft_p99_s, grow_below), share(slo.itl_p99_s, grow_below),
                   share(slo.ttft_p99_s, ease_above), share(slo.itl_p99_s, ease_above))

    @classmethod
    def from_baseline(cls, ttft_p99_s: float | None, itl_p99_s: float | None) -> GuardTargets:
        """BASELINE_MARGIN x the baseline; growth in the lower half of the margin (at the baseline itself
        the batch grows: 0.8 x target would be the baseline, where a batch of 1 already is), easing off
        in its last quarter."""
        def margin(p99_s: float | None, share: float) -> float | None:
            return None if p99_s is None else p99_s * (1 + (BASELINE_MARGIN - 1) * share)

        return cls(margin(ttft_p99_s, 1.0), margin(itl_p99_s, 1.0), margin(ttft_p99_s, 0.5), margin(itl_p99_s, 0.5),
                   margin(ttft_p99_s, 0.75), margin(itl_p99_s, 0.75))


# a histogram bucket whose top is this many times its bottom or more is wide: vLLM's first-token buckets from
# 0.1 to 0.25 s, 1 to 2.5 s and 2.5 to 5 s (a p99 interpolated near its top may be anywhere in it)
WIDE_BUCKET = 2.0


def _under(p99_s: float | None, bound_s: float | None) -> bool:
    return bound_s is None or (p99_s is not None and p99_s < bound_s)


def _surely_under(p99_s: float | None, bucket_s: tuple[float, float] | None, bound_s: float | None) -> bool:
    """The p99 is under the bound for sure: its value is, and so is the top of what is known of it (the
    histogram bucket it lies in, or the upper bound of the batch's own gaps)."""
    return _under(p99_s, bound_s) and (bucket_s is None or _under(bucket_s[1], bound_s))
