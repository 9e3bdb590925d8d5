"""The latency guard's rules as data: its tuned numbers (`GuardPolicy`, each with what set it),
its phases, the verdicts a window of evidence gives, and the transition table between them.

Invariant: the guard changes its allowance only by `TRANSITIONS`: a phase and a verdict give
the next phase and the one change of the allowance that goes with it. A phase is the single
truth of what the guard is doing; nothing is implied by a missing value.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GuardPolicy:
    """Every number the guard runs on. Production uses the defaults; tests build it the same way."""

    # p99s over the last 10 s: vLLM's own progress log period; a level shows itself within it.
    window_s: float = 10.0
    # A window without `min_observations` online ones widens back up to this: an online request on a
    # slow server (one AVX2 core: 2-5 s to first token alone, answers of 20-60 s) outlasts 10 s.
    max_window_s: float = 60.0
    # A lull the batch may grow in once online requests have been on the server: no request but the
    # batch's for this long, not a window (a server that never had any: a window). Grown in the 10 s
    # gaps between light online arrivals, the batch met the next ones at 8-13 in flight: their first-token
    # p99 1.91x, inter-token 1.33-1.49x of alone (coserve matrix, second run, (c) and (e), 2026-11-28).
    lull_s: float = 45.0
    # Held back beside online requests, one try at 1 beside them again after this, doubled at each hold in
    # a row up to `max_held_retry_s`: held on one sure excess early in a light phase, the batch sat at 0-1
    # for a whole 270 s run whose later light phase had room for 5-7 (coserve (a), 90 s phases,
    # 2026-11-28); a try costs at most one window of the online traffic beside one batch request.
    held_retry_s: float = 60.0
    max_held_retry_s: float = 960.0
    # The online traffic alone, before any batch request: 8 s held a light load's ~10 first tokens.
    baseline_s: float = 8.0
    # Observations a p99 needs before the guard grows on it (5 online first tokens: a p99 of fewer
    # is one request's luck); also the first tokens a baseline at concurrency 1 takes.
    min_observations: int = 5
    # The batch's own token gaps beside online requests that make the online inter-token p99 (fewer:
    # the server's histogram): 20 gaps are half a second of one stream at 25 ms a token, 20 s at 1 s;
    # a nearest-rank p99 of fewer than 100 is their largest, which errs toward a cut.
    own_gaps_min: int = 20
    # A level (or a cut) is judged on what it showed itself once it ran this long: judged on a window
    # still full of the previous level, the guard grew past the right level (stop 36's runs).
    judge_after_s: float = 2.0
    # A cut halves (as TCP does); growth doubles until the first cut or ease-off, then adds one (10 %
    # from 20 up); beside online requests, at most as far as the evidence leaves room for
    # (`guard_evidence.growth_room`).
    cut_factor: float = 0.5
    # The band below an SLO target: grow under 0.75 x it, ease off by one over 0.9 x it (0.6 left
    # half the batch on the table; 0.9 alone broke 2 of 5 windows in stop 36's runs).
    grow_below: float = 0.75
    ease_above: float = 0.9
    # Snapshots of a window that showed requests waiting beside online ones before the window is no room to
    # grow: a server whose online requests queue is at its capacity, and on a saturating online load every
    # batch step adds to a backlog that does not drain. Grown to 8-9 in such a load's first 20 s (first-token
    # p99 2.4 s, far under coserve's lax 12 s target, nothing waiting at the scrapes it judged on), the batch
    # left (b)'s steady window at 1.41x alone's first-token p99 in one run of two; held at 1, 0.97x (coserve
    # matrix, AVX-512 host, 2026-11-28). Two, not one: a batch request just sent waits a step too.
    queued_scrapes: int = 2
    # Online requests on the server rising through the window beyond their noise is a load still building,
    # no room to grow: its steady state is unknown. Rising: the second half's mean over the first's by more
    # than this many Poisson sigmas (sqrt of the first's mean, at least 1) and 1. A saturating load fills
    # the server before anything waits: grown to 4 in (b)'s ramp (nothing queued at the scrapes it judged
    # on), the batch left its steady window at 1.28x alone's first-token p99 (coserve matrix, AVX-512 host,
    # 2026-11-28). At 2 sigmas a light load's 0-2 online requests and a heavy one's 2-5 read as steady. The same
    # bound says a load eased: held back, the batch tries again sooner once the online first tokens come at a
    # lower rate than beside the hold by more than this many binomial sigmas (`guard_evidence.load_eased`).
    rising_sigmas: float = 2.0
    # The newest scrape's online requests over the mean of the window's earlier ones by more than this many Poisson
    # sigmas (of that mean, at least 1) and 1 is a surge (`Verdict.SURGE`): 0 at once, a load no level was judged
    # beside. At 1-2 batch requests grown in a light load, the batch met (d)'s bursts (10x the light rate for 5 s)
    # and left a burst's window at 1.65x alone's first-token p99 (coserve matrix, AVX-512 host, 2026-11-29). A burst
    # from 0.8 to 8 online requests clears 3 sigmas at once; at 2 (as the rise), a scripted light load's own noise
    # (1.6 online requests on average) read as a surge twice in 4 minutes, each costing a window at 0 and the growth.
    surge_sigmas: float = 3.0
    # WAITING's and HELD's trickle of 1 starts only once the server had no online request for this many of
    # the online traffic's mean arrival gaps (over the history): a gap of one scrape in heavy traffic is no
    # room, the next arrivals meet the request it let in. Started in such gaps of (a)'s heavy phase (1.42
    # online requests a second, 2.4 on the server on average), the batch at most 1 in flight left its
    # window's online inter-token p99 at 1.26x alone (coserve matrix, AVX-512 host, 2026-11-28). Poisson
    # arrivals leave a quiet stretch of 3 mean gaps e^-3 = 5 % of the time; a load that eased off, often.
    trickle_quiet_gaps: float = 3.0
    # Beside online requests, no growth while the server's step (the batch's own median token gap in the window)
    # is over this many times the fastest the guard has seen: a server that slow is saturated by its online
    # traffic, a queue near its capacity that every batch request takes from, whatever the latency against a
    # lax target. Alone, the online traffic's inter-token p50 over idle was 1.0x in coserve's heavy phases
    # ((a), (e)), 1.9x in its bursts (d), 10-14x under (b)'s saturating load; there the batch grew to 4-8 in
    # flight through the ramp, every level's first tokens far under the target (2.3 s against 10.2 s), and left
    # the steady window at 1.9x alone's first-token p99 (coserve (b), AVX-512 host, 2026-11-28). At 0 in flight
    # the batch has no gaps: the server's inter-token histogram's median, its bucket wholly over this bound.
    saturated_pace: float = 3.0
    # An inter-token excess from the batch's own gaps (and its prefills') is judged on the p99 at the least their noise
    # allows, the weight over it 1 % of theirs and this many binomial sigmas more (`weighted_p99_at_least`): the
    # nearest-rank p99 of a 10 s window's few hundred weighted gaps is its few largest, and on 1-4 gaps of 110-170 ms
    # the batch was cut six times in 3 minutes of coserve (a), where the clients' 30 s windows kept 0.53-0.97x alone's
    # inter-token p99 (AVX-512 host, 2026-11-29). At 2 sigmas the online load alone,
    # its gaps over the target half as often as a p99's (0.5 %), shows such an excess in a window of 300 gaps about
    # once in a thousand, where the nearest-rank p99 (their 4th largest) is over it in one window of fifteen.
    # Growth judges the same p99 at the most their noise allows, this many sigmas less (`weighted_p99_at_most`): grown on
    # nearest-rank p99s of 61 and 58 ms against a 64 ms bound, the batch broke coserve (a)'s heavy window at 1.29x (a host
    # of family 26, 2026-11-30); on the upper bound, (a) kept on that host (1.10x).
    excess_sigmas: float = 2.0
    # KV use: a server at 95 % preempts soon; growth stops at 90 %.
    kv_usage_cut: float = 0.95
    kv_usage_grow: float = 0.9

    def __post_init__(self) -> None:
        for name in ("window_s", "baseline_s", "judge_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.window_s <= self.max_window_s:
            raise ValueError(f"max_window_s must be >= window_s {self.window_s!r}, got {self.max_window_s!r}")
        if not self.window_s <= self.lull_s <= self.max_window_s:
            raise ValueError(f"lull_s must be in [window_s {self.window_s!r}, max_window_s {self.max_window_s!r}] (the history "
                             f"keeps max_window_s), got {self.lull_s!r}")
        if not self.window_s <= self.held_retry_s <= self.max_held_retry_s:
            raise ValueError(f"need window_s {self.window_s!r} <= held_retry_s <= max_held_retry_s, got held_retry_s "
                             f"{self.held_retry_s!r}, max_held_retry_s {self.max_held_retry_s!r}")
        if not self.judge_after_s <= self.window_s:
            raise ValueError(f"judge_after_s must be in (0, window_s {self.window_s!r}] (a level is judged inside the window), "
                             f"got {self.judge_after_s!r}")
        if not (self.min_observations >= 1 and self.own_gaps_min >= 1 and self.queued_scrapes >= 1):
            raise ValueError(f"min_observations, own_gaps_min and queued_scrapes must be >= 1, got {self.min_observations!r}, "
                             f"{self.own_gaps_min!r}, {self.queued_scrapes!r}")
        if not self.trickle_quiet_gaps >= 0:
            raise ValueError(f"trickle_quiet_gaps must be >= 0, got {self.trickle_quiet_gaps!r}")
        if not self.saturated_pace >= 1:
            raise ValueError(f"saturated_pace must be >= 1, got {self.saturated_pace!r}")
        if not (self.rising_sigmas >= 0 and self.surge_sigmas >= 0 and self.excess_sigmas >= 0):
            raise ValueError(f"rising_sigmas, surge_sigmas and excess_sigmas must be >= 0, got {self.rising_sigmas!r}, "
                             f"{self.surge_sigmas!r}, {self.excess_sigmas!r}")
        if not 0 < self.cut_factor < 1:
            raise ValueError(f"cut_factor must be in (0, 1), got {self.cut_factor!r}")
        if not 0 < self.grow_below <= self.ease_above <= 1:
            raise ValueError(f"need 0 < grow_below <= ease_above <= 1, got grow_below {self.grow_below!r}, "
                             f"ease_above {self.ease_above!r}")
        if not 0 < self.kv_usage_grow <= self.kv_usage_cut <= 1:
            raise ValueError(f"need 0 < kv_usage_grow <= kv_usage_cut <= 1, got {self.kv_usage_grow!r}, {self.kv_usage_cut!r}")


class GuardPhase(enum.Enum):
    BASELINE = "measuring baseline"  # 0 in flight: what the online traffic shows alone
    WAITING = "waiting"  # over target (or saturated) alone: 0 in flight, 1 after a quiet stretch without online requests
    HELD = "held back"  # one batch request beside online ones broke a target: 0 until a lull, a lighter load, or one
    # try beside them after a backoff
    SLOW_START = "slow start"  # guarding; growth doubles (at most to the evidence's room)
    STEADY = "guarding"  # guarding; growth adds one, an excess eases off by one
    DRAINING = "draining a cut"  # a cut: until the batch is down to its allowance


GUARDING_PHASES = frozenset({GuardPhase.SLOW_START, GuardPhase.STEADY, GuardPhase.DRAINING})


class Verdict(enum.Enum):
    """What a window of evidence says of the level the batch runs at."""

    CUT = "cut"  # a p99 over its target (a silence counted in as a gap; by itself over the first-token target), a preemption,
    # a queue, KV nearly full
    EASE = "ease off"  # a p99 over its ease bound
    GROW = "grow"  # positive evidence of room: enough online observations under the growth bounds, or a lull (no online traffic)
    HOLD = "hold"  # inside the band, or too little evidence to say
    # online requests are on the server again after a lull the batch grew in: back at once to the
    # level last judged beside them (the lull's growth was judged harmless to nobody, not to them)
    RETURN = "return"
    # the online requests on the server jumped beyond their noise since the window's earlier scrapes (a burst, a
    # load turning heavy): no level was judged beside such a load, and it meets whatever runs: 0 at once
    SURGE = "surge"


@dataclass(frozen=True)
class Levels:
    """What an allowance changes from: the present one, the last one judged beside online requests, and
    the most growth may reach on the evidence."""

    allowed: int
    beside_online: int
    grow_at_most: int | None = None  # `guard_evidence.growth_room`; None: no bound (a lull, no metrics)


def _halve(levels: Levels, policy: GuardPolicy) -> int:
    return math.floor(levels.allowed * policy.cut_factor)


def _one_less(levels: Levels, policy: GuardPolicy) -> int:
    return max(1, levels.allowed - 1) if levels.allowed > 0 else 0


def _double(levels: Levels, policy: GuardPolicy) -> int:
    return _at_most_room(levels, max(1, 2 * levels.allowed))


def _one_more(levels: Levels, policy: GuardPolicy) -> int:
    return _at_most_room(levels, levels.allowed + max(1, levels.allowed // 10))


def _at_most_room(levels: Levels, grown: int) -> int:
    """Growth to `grown`, at most to the evidence's room, and by one at least (growth was judged on evidence
    of room for one more: the growth bounds)."""
    return grown if levels.grow_at_most is None else max(levels.allowed + 1, min(grown, levels.grow_at_most))


def _same(levels: Levels, policy: GuardPolicy) -> int:
    return levels.allowed


def _beside_online(levels: Levels, policy: GuardPolicy) -> int:
    return min(levels.allowed, levels.beside_online)


def _none(levels: Levels, policy: GuardPolicy) -> int:
    return 0


# (phase, verdict) -> (next phase, the allowance's change, before `max_in_flight` caps it). The
# guarding phases only: BASELINE and WAITING end by what the online traffic shows alone, DRAINING
# when the batch came down (both in `LatencyGuard`).
TRANSITIONS = {
    (GuardPhase.SLOW_START, Verdict.CUT): (GuardPhase.DRAINING, _halve),
    (GuardPhase.SLOW_START, Verdict.RETURN): (GuardPhase.DRAINING, _beside_online),
    (GuardPhase.SLOW_START, Verdict.SURGE): (GuardPhase.DRAINING, _none),
    (GuardPhase.SLOW_START, Verdict.EASE): (GuardPhase.STEADY, _one_less),
    (GuardPhase.SLOW_START, Verdict.GROW): (GuardPhase.SLOW_START, _double),
    (GuardPhase.SLOW_START, Verdict.HOLD): (GuardPhase.SLOW_START, _same),
    (GuardPhase.STEADY, Verdict.CUT): (GuardPhase.DRAINING, _halve),
    (GuardPhase.STEADY, Verdict.RETURN): (GuardPhase.DRAINING, _beside_online),
    (GuardPhase.STEADY, Verdict.SURGE): (GuardPhase.DRAINING, _none),
    (GuardPhase.STEADY, Verdict.EASE): (GuardPhase.STEADY, _one_less),
    (GuardPhase.STEADY, Verdict.GROW): (GuardPhase.STEADY, _one_more),
    (GuardPhase.STEADY, Verdict.HOLD): (GuardPhase.STEADY, _same),
}
