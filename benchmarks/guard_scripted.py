"""The latency guard over scripted servers on a fake clock (testkit/scripted_server.py), 8 seeds a load:
the batch's tokens against the best fixed concurrency that kept every 30 s window, and the windows it
broke. A proxy of coserve.py's matrix that runs in seconds (11 s on an AVX-512 host) with no server, for trying a guard
rule on many seeds before a real run; its servers are models, coserve's verdicts are the real ones.

    .venv/bin/python benchmarks/guard_scripted.py [--seeds 8]

The guard's SLO is coserve's: 1.25x the online p99s alone (first token and inter-token) over the
whole load. A window breaks when its online p99 is over 1.25x alone's p99 of the stretch judged (from
30 s on for a steady load: `scripted_server.worst_ratio`, as the guard's tests judge). Per load it prints the median over seeds of the
batch's tokens over the best safe fixed concurrency's (`c`; n/a where no fixed one kept every
window), the seeds with a window broken and the worst window's p99 over alone's; then which fixed level
each seed picked, and the batch against the largest level that kept every window in every seed (a fixed
level chosen before the arrivals are seen: a seed's own best is a maximum over its luck).

Loads (online requests of 32-48 tokens; the batch's of 64-128):
    light          a fast server (20 ms a step, 2 ms a request), 1 online request a second
    heavy+client   the same at 5 a second, 150 ms of client time in each batch first token
    lhl-fast       the fast server, 1 / 5 / 1 a second for 60 s each
    lhl-cpu-like   16 ms a step and 0.8 ms a request, 20 ms more for a step with a prefill (a small
                   model on CPU cores: the step's fixed part dominates), 0.9 / 2.7 / 0.9 a second for
                   30 s each, as coserve (a)'s phases
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchllm.engines.endpoint.guard_policy import GuardPhase  # noqa: E402
from batchllm.engines.endpoint.latency_guard import LatencyGuard  # noqa: E402
from testkit.scripted_server import FAST, Scenario, phased_arrivals, poisson, run, slo_of, worst_ratio  # noqa: E402

CPU_LIKE = lambda n: 0.016 + 0.0008 * n  # noqa: E731
FIXED_LEVELS = (1, 2, 4, 8, 16)
WINDOW_S = 30.0


class Fixed:
    """A client that keeps `level` batch requests in flight whatever it sees (coserve's fixed sides)."""

    phase = GuardPhase.STEADY

    def __init__(self, level: int):
        self.level = level

    def allowed(self, now_s: float, in_flight: int) -> int:
        return self.level

    def observe_server(self, snapshot) -> None:
        pass

    def observe_silence(self, now_s: float, silent_s: float) -> None:
        pass

    def observe_own(self, now_s: float, ttft_s: float | None, gaps_s) -> None:
        pass


@dataclass(frozen=True)
class Load:
    name: str
    scenario: Callable[[int], Scenario]  # of a seed
    duration_s: float
    judged_from_s: float  # windows from here (the first 30 s of a steady load is the guard's start)


LOADS = (
    Load("light", lambda s: Scenario(FAST, poisson(1.0, 180, seed=s), online_tokens=32), 180.0, 30.0),
    Load("heavy+client", lambda s: Scenario(FAST, poisson(5.0, 180, seed=s), online_tokens=32, client_s=0.15), 180.0, 30.0),
    Load("lhl-fast", lambda s: Scenario(FAST, phased_arrivals((1.0, 5.0, 1.0), 60.0, s), online_tokens=32), 180.0, 30.0),
    Load("lhl-cpu-like", lambda s: Scenario(CPU_LIKE, phased_arrivals((0.9, 2.7, 0.9), 30.0, s), online_tokens=48, batch_tokens=128,
                                            prefill_s=0.02), 90.0, 0.0),
)


def measure(load: Load, seeds: range) -> str:
    shares, robust_shares, worst, broken, picks = [], [], [], 0, []
    kept_tokens: list[dict[int, int]] = []  # per seed: the batch tokens of each fixed level that kept every window
    guarded_tokens = []
    for seed in seeds:
        scenario = load.scenario(seed)
        alone = run(replace(scenario, client_s=0.0), None, load.duration_s)
        guarded = run(scenario, LatencyGuard(slo_of(alone, 0.0, load.duration_s), 64), load.duration_s)
        kept: dict[int, int] = {}
        for level in FIXED_LEVELS:
            fixed = run(replace(scenario, client_s=0.0), Fixed(level), load.duration_s)  # type: ignore[arg-type]
            if worst_ratio(alone, fixed, load.judged_from_s, load.duration_s, WINDOW_S) > 1.25:
                break
            kept[level] = fixed.batch_tokens
        ratio = worst_ratio(alone, guarded, load.judged_from_s, load.duration_s, WINDOW_S)
        worst.append(ratio)
        broken += ratio > 1.25
        picks.append(max(kept, default=0))
        if kept:
            shares.append(guarded.batch_tokens / kept[max(kept)])
        kept_tokens.append(kept)
        guarded_tokens.append(guarded.batch_tokens)
    # the level that kept every window in every seed, were a fixed client to be chosen before the load is seen
    robust = min(picks)
    if robust:
        robust_shares = [tokens / levels[robust] for tokens, levels in zip(guarded_tokens, kept_tokens)]
    c = f"{statistics.median(shares):.2f}x" if shares else "n/a"
    c_robust = f"{statistics.median(robust_shares):.2f}x of {robust}" if robust_shares else "n/a"
    spread = ", ".join(f"{level or 'none'} x{picks.count(level)}" for level in sorted(set(picks)))
    return (f"{load.name:<14} c {c:>6}  seeds with a window broken {broken}/{len(seeds)}  worst {max(worst):.2f}x  "
            f"(best fixed per seed: {spread}; against the level that kept every seed: {c_robust})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=8, help="seeds a load (default 8)")
    count = parser.parse_args().seeds
    if count < 1:
        parser.error(f"--seeds must be at least 1, got {count}")
    seeds = range(20, 20 + count)
    print(f"the latency guard over scripted servers, seeds {seeds.start}-{seeds.stop - 1}; c: the batch's tokens over the "
          f"best fixed concurrency ({', '.join(map(str, FIXED_LEVELS))}) that kept every {WINDOW_S:.0f} s window (median)")
    for load in LOADS:
        print(measure(load, seeds), flush=True)


if __name__ == "__main__":
    main()
