"""What a window of a shared server's life shows the latency guard (`WindowEvidence`, read from the
server's snapshots by `server_history.ServerHistory`, or from the batch's own timings without them),
and the verdict it gives (`judge`): cut, ease off, grow, hold, return or surge.

Invariant: growth needs positive evidence, and a cut evidence of an excess (a first-token p99 over
its target interpolated in its bucket: there is nothing surer of it; an inter-token one for sure,
or a silence). What holds the batch back for long (`sure`) needs the first-token p99's whole
bucket over the target. A window grows the batch only when it holds enough
online observations under the growth bounds, or shows the server with no request but the
batch's in every snapshot; and never while online requests queue on the server (a latency
under a lax target is no room on a server at its capacity) or their number on it rises through
the last window beyond its noise (a load still building). Silence is not room: online requests
on the server with too few observations of them hold the level, and a silence of the batch's own
streams beside them, too long for the inter-token p99 it is counted in, cuts by itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchllm.engines.endpoint.guard_policy import GuardPolicy, Verdict
from batchllm.engines.endpoint.guard_targets import OWN_REQUESTS, SERVER_METRICS, GuardTargets
from batchllm.engines.endpoint.latency_window import OwnTimings, WindowLatency, own_latency

# Observations a p99 is a p99 of: of fewer, the nearest rank is their largest. A sure inter-token excess needs
# them: held back on the largest of 60 gaps (one online prompt's prefill, 217 ms against a 143 ms target) 2 s
# after a cut to 1 in a heavy phase, the batch sat at 0 through the light phase after it (coserve (a), AVX-512
# host, 2026-11-29), where the probe a window after a plain cut to 0 would have run 1.
P99_OF_AT_LEAST = 100


@dataclass(frozen=True)
class WindowEvidence:
    basis: str  # SERVER_METRICS: the online traffic's latency; OWN_REQUESTS: the batch's own (no metrics)
    span_s: float  # how long a stretch it is over
    latency: WindowLatency
    online_seen: bool  # online requests were on the server (always assumed on the batch's own timings)
    preempted: bool
    kv_usage: float | None
    waiting: float | None
    queue_held: bool  # requests waited in the newest snapshot and the one before
    online_queued: bool  # requests waited, online ones on the server, in `queued_scrapes` of the window's snapshots
    running: float | None
    silent_s: float  # the longest any of the batch's decoding streams has now gone without a token
    silence_in_p99: bool = False  # that silence is one of the gaps the inter-token p99 is of (right-censored), not a verdict of its own
    idle_s: float = 0.0  # how long, up to now, the server held nothing but the batch's requests (whatever `since_s`)
    online_rising: bool = False  # online requests on the server rose through the window beyond their noise: a load still building
    online_surging: bool = False  # the newest scrape's online requests over the window's earlier ones beyond their noise
    online_ever: bool = False  # online requests have been on the server since the guard began
    pace_s: float | None = None  # the median of the batch's own token gaps in the window: the server's step as it ran
    # the lower bound of the bucket the server's median token gap (all requests: one step of a decoding batch, whoever's)
    # lies in: a bound, not a value, it can show a server saturated, never one with room
    server_pace_at_least_s: float | None = None

    def idle(self, policy: GuardPolicy) -> bool:
        """A lull: the server held nothing but the batch's requests for a whole window, or, once online
        requests have been on it, for `lull_s` (the gaps between light online arrivals are longer than
        a window, and the next arrival meets whatever the batch grew to). An online request that comes
        finds the batch at a level the lull showed harmless to nobody, not to it: RETURN then."""
        return self.basis == SERVER_METRICS and self.idle_s >= (policy.lull_s if self.online_ever else policy.window_s)

    @property
    def saturated(self) -> bool:
        """The server itself says it is full: it preempted, or requests waited in two scrapes in a row."""
        return self.preempted or self.queue_held


def excess(evidence: WindowEvidence, targets: GuardTargets, policy: GuardPolicy, *, ease: bool = False,
           sure: bool = False) -> str | None:
    """What in the evidence is over its target (`ease`: over its ease bound), in words; None: nothing.
    A first-token p99 (`_ttft_over_s`) and an inter-token one (`_itl_over_s`) each as a cut or a hold
    (`sure`) judges it, a silence of the batch's streams beside online requests as a gap at least that
    long (in the p99 where it is one of its gaps; over the first-token bound, by itself); the server's
    preemptions, queue and KV use count too."""
    latency, t = evidence.latency, targets
    ttft_bound, itl_bound = (t.ttft_ease_over_s, t.itl_ease_over_s) if ease else (t.ttft_target_s, t.itl_target_s)
    silent_s = evidence.silent_s if evidence.online_seen else None
    bound = "ease bound" if ease else "target"
    if (ttft_s := _ttft_over_s(latency, ttft_bound, sure)) is not None:
        assert ttft_bound is not None
        return f"online p99 TTFT {ttft_s:.2f} s over its {bound} {ttft_bound:.2f} s"
    if (itl_s := _itl_over_s(latency, itl_bound, sure)) is not None:
        assert itl_bound is not None
        return f"online p99 inter-token {itl_s * 1000:.0f} ms over its {bound} {itl_bound * 1000:.0f} ms"
    if silent_s is not None and itl_bound is not None and silent_s > itl_bound and not evidence.silence_in_p99:
        return f"a batch stream silent for {silent_s:.1f} s beside online requests, over the inter-token {bound} {itl_bound * 1000:.0f} ms"
    if silent_s is not None and ttft_bound is not None and silent_s > ttft_bound:
        return f"a batch stream silent for {silent_s:.1f} s beside online requests, over the first-token {bound} {ttft_bound:.2f} s"
    if evidence.preempted:
        return "the server preempted requests"
    if evidence.queue_held:
        return "requests waited on the server in two scrapes in a row"
    if not ease and evidence.kv_usage is not None and evidence.kv_usage > policy.kv_usage_cut:
        return f"KV cache {evidence.kv_usage:.0%} full"
    return None


def _ttft_over_s(latency: WindowLatency, bound_s: float | None, sure: bool) -> float | None:
    """The first-token p99 a cut or a hold judges, when it is over `bound_s`; None: it is not (or unknown).
    A cut: interpolated in its bucket with the bucket's observations spread evenly through it
    (`_centred`). A hold (`sure`): as Prometheus has it, its whole bucket over the bound."""
    if sure:
        return latency.ttft_p99_s if _surely_above(latency.ttft_p99_s, latency.ttft_p99_bucket_s, bound_s) else None
    centred_s = _centred(latency)
    return centred_s if _above(centred_s, bound_s) else None


def _itl_over_s(latency: WindowLatency, bound_s: float | None, sure: bool) -> float | None:
    """The inter-token p99 a cut or a hold judges, when it is over `bound_s`; None: it is not (or unknown).
    Of the batch's own gaps, a cut judges their p99 at the least their noise allows with each prefill's gap
    at the middle of its bounds (`itl_p99_centred_s`). From the server's histogram, or for a hold (`sure`,
    and then of `P99_OF_AT_LEAST` gaps or more), the p99 over for sure (`_surely_above`)."""
    if not sure and latency.itl_p99_centred_s is not None:
        return latency.itl_p99_centred_s if _above(latency.itl_p99_centred_s, bound_s) else None
    over = _surely_above(latency.itl_p99_s, latency.itl_p99_bucket_s, bound_s) and (not sure or latency.itl_count >= P99_OF_AT_LEAST)
    return latency.itl_p99_s if over else None


def judge(evidence: WindowEvidence, targets: GuardTargets, policy: GuardPolicy) -> Verdict:
    """CUT over a target (or on the server's signs of overload), SURGE when the online requests on the
    server just jumped, EASE over the ease bound, GROW on positive evidence of room once the stretch
    is `judge_after_s` long, else HOLD."""
    if excess(evidence, targets, policy) is not None:
        return Verdict.CUT
    if evidence.online_surging:
        return Verdict.SURGE
    if evidence.span_s < policy.judge_after_s:
        return Verdict.HOLD
    if excess(evidence, targets, policy, ease=True) is not None:
        return Verdict.EASE
    return Verdict.HOLD if no_room(evidence, targets, policy) else Verdict.GROW


def no_room(evidence: WindowEvidence, targets: GuardTargets, policy: GuardPolicy) -> str | None:
    """Why the evidence shows no room to grow, in words (the same words each time: a guard's log counts
    them); None: it shows room (a lull, or enough online observations under the growth bounds, nothing
    waiting, the load steady, KV not nearly full). Not judged on a cut or an ease-off: see `excess`."""
    kv, latency, t = evidence.kv_usage, evidence.latency, targets
    if (evidence.waiting or 0) > 0:
        return "requests waiting on the server"
    if evidence.online_queued:
        return "online requests queued in the window"
    if evidence.online_rising:
        return "online requests on the server rising"
    if kv is not None and kv > policy.kv_usage_grow:
        return "KV cache nearly full"
    if evidence.idle(policy):
        return None
    if not ((t.ttft_target_s is None or latency.ttft_count >= policy.min_observations)
            and (t.itl_target_s is None or latency.itl_count >= policy.min_observations)):
        return "too few online observations"
    if not t.lets_grow(latency):
        return "online p99 over its growth bound"
    if evidence.online_seen and _above(evidence.silent_s, t.itl_grow_under_s):
        return "a batch stream silent over the inter-token growth bound"
    return None


def growth_room(evidence: WindowEvidence, targets: GuardTargets, allowed: int) -> int | None:
    """The most batch requests the evidence leaves room for beside online requests: as many as keep each
    online p99 under its ease bound were it to grow in proportion to the requests on the server (a step's
    time grows less than that: it has a part no request adds to). None: no bound (no online request seen,
    no count of the server's requests, or no p99 with a bound). Doubled on p99s under the growth bounds,
    the batch went from 8 to 16 beside a scripted light load (first-token p99 0.08 s, target 0.11 s), whose
    first tokens then took 0.24 s: of 8 seeds of a light-heavy-light load, 4 broke a window, up to 1.63x
    alone's first-token p99; capped here, 1 of the 8, at 1.32x, where the heavy load met a batch grown in
    the light (`benchmarks/guard_scripted.py`)."""
    if not evidence.online_seen or evidence.running is None:
        return None
    latency, on_server = evidence.latency, max(float(allowed), evidence.running + (evidence.waiting or 0.0))
    factors = [bound / p99 for p99, bound in ((latency.ttft_p99_s, targets.ttft_ease_over_s),
                                              (latency.itl_p99_s, targets.itl_ease_over_s))
               if p99 is not None and p99 > 0 and bound is not None]
    if not factors:
        return None
    return math.floor(on_server * min(factors) - (on_server - allowed))


def load_eased(before: WindowEvidence, after: WindowEvidence, sigmas: float) -> bool:
    """The online traffic came at a lower rate in `after` than in `before`, beyond its noise: of the
    online first tokens of both stretches (Poisson counts: one per request, whatever its length), the
    share in `after` under its share of their time by more than `sigmas` binomial sigmas."""
    came_before, came_after = before.latency.ttft_count, after.latency.ttft_count
    both = came_before + came_after
    if both <= 0 or before.span_s <= 0 or after.span_s <= 0:
        return False
    share = after.span_s / (before.span_s + after.span_s)
    return came_after < both * share - sigmas * math.sqrt(both * share * (1 - share))


def own_evidence(own: OwnTimings, now_s: float, since_s: float, window_s: float, silent_s: float) -> WindowEvidence:
    """The batch's own latency over the last window (no server metrics): online traffic is assumed there."""
    from_s = max(now_s - window_s, since_s)
    return WindowEvidence(OWN_REQUESTS, now_s - from_s, own_latency(own, from_s, now_s), online_seen=True, preempted=False,
                          kv_usage=None, waiting=None, queue_held=False, online_queued=False, running=None, silent_s=silent_s)


def _centred(latency: WindowLatency) -> float | None:
    """The first-token p99 an excess is judged on: from a histogram, with its bucket's observations spread
    evenly through it (`Histogram.quantile_centred`), not at its top. vLLM's bucket from 0.1 to 0.25 s holds
    targets (alone's p99 x 1.25: 0.24 s in coserve (e)), and the p99 of a window's few online first tokens,
    interpolated as Prometheus does, sits near the top of the bucket its largest lies in: one first token
    over 0.1 s, as the online traffic alone has, reads as about 0.24 s. Two of (e)'s cuts from 1 to 0 in
    13 s came with such a reading against the 0.24 s target (the inter-token p99 under its own), where the
    online clients' windows were at 0.81-1.04x alone's first-token p99 (coserve (e), AVX-512 host,
    2026-11-29). Growth still needs the p99 as `quantile` has it under its bound."""
    return latency.ttft_p99_s if latency.ttft_p99_centred_s is None else latency.ttft_p99_centred_s


def _above(value_s: float | None, bound_s: float | None) -> bool:
    return value_s is not None and bound_s is not None and value_s > bound_s


def _surely_above(p99_s: float | None, bucket_s: tuple[float, float] | None, bound_s: float | None) -> bool:
    """The p99 is over the bound for sure: its exact value is, or the whole histogram bucket it lies in
    (lower, upper] is. vLLM's buckets are wide where targets lie (first tokens 1.0-2.5 s and
    0.1-0.25 s, token gaps 25-50 ms and 100-150 ms), and an interpolated p99 of a few observations
    sits near its bucket's top: with 3 first tokens and the slowest in (1.0, 2.5], 2.455 s whatever
    that token's time. Held back on it, the guard read "online p99 TTFT 2.45 s over its target
    2.14 s" beside one batch request in coserve (a) runs where the online clients' worst 30 s window
    p99 was 1.42 s and 1.68 s, and kept the batch at 0-1 for the rest of the run. The batch's own gaps and
    its prefills' (some known only by bounds) are over for sure when their p99 at the least their noise
    allows, with each at its lower bound, is."""
    if bucket_s is None or bucket_s[0] == bucket_s[1]:
        return _above(p99_s, bound_s)
    return bound_s is not None and bucket_s[0] >= bound_s
