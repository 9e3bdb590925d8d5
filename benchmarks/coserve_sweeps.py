"""How far coserve's oracle, the best safe fixed concurrency, holds from one run to the next: the fixed
client's sweeps of scenarios (a) and (e) across the matrices in benchmarks/results, read from their reports.

    python benchmarks/coserve_sweeps.py [REPORT ...]   (default: benchmarks/results/coserve-matrix-*.txt)

A sweep runs the fixed client at 1, 2, 4, 8 ... in flight and stops at the first level that breaks a
judged window, so a level above a broken one was not run: it is counted as broken (a larger fixed
batch beside the same load is not kinder). Per report it prints the host's idle online request time,
each level's worst judged window (the larger of its first-token and inter-token p99 over alone's
heaviest, * where the report judged it over the SLO) and the level picked. Then per scenario and level
over the reports: how often it kept the reference (heavy) window, the later ones and every one, its
batch tokens/s, and that over the level each run picked (the median over the runs that ran it and
picked one, whether or not it kept its windows).

Two rules of picking are read: the reference phase's windows only (how coserve.py picked until
2026-12-07) and every window after the first (the issue's "best fixed concurrency that kept every
window", how it picks since). Last, each fixed level judged as if it were the batch side: in how many
runs it kept every window of (a) and (e) with c >= 1.0 (a bound on what the issue's check asks: a level
chosen in hindsight, over runs it was not tuned on, and no (b)-(d) to keep). Only reports with
per-window cells are read; others are listed as skipped.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SCENARIOS = ("(a)", "(e)")
C_TARGET = 1.0  # the issue's: the batch over the best safe fixed concurrency, the median over (a) and (e)
CELL = re.compile(r"([\d.]+)/([\d.]+)(\*?)")
SWEEP_ROW = re.compile(r"^sweep(\d+)\s+\S+\s+\d+\s+\d+\s+\S+\s+\S+\s+\S+\s+\S+\s+([-\d.]+)\s", re.M)
PER_WINDOW = re.compile(r"^ +per window (.*?);", re.M)
IDLE = re.compile(r"request p50 ([\d.]+) s")


@dataclass(frozen=True)
class Level:
    """One level of one sweep: its judged windows' worst p99 ratios and the batch tokens/s over its phases."""

    in_flight: int
    windows: tuple[float, ...]  # per window after the first: the larger of its two ratios
    broken: tuple[bool, ...]  # per window: the report's verdict (its *; a ratio printed as 1.25 may be over 1.25)
    tokens_per_s: float

    def keeps_every_window(self) -> bool:
        return not any(self.broken)

    def keeps_reference_window(self) -> bool:
        """The first window after the first lies in (a)'s and (e)'s heavy phase, their reference."""
        return not self.broken[0]

    def keeps_later_windows(self) -> bool:
        return not any(self.broken[1:])


def read_sweeps(text: str) -> dict[str, list[Level]]:
    """The sweeps of (a) and (e) in one report, levels in the order run."""
    sweeps = {}
    body = text.split("== guard log")[0]
    for label in SCENARIOS:
        start = body.find(f"== {label} ")
        if start < 0:
            continue
        end = body.find("\n== (", start + 1)
        block = body[start:end if end > 0 else len(body)]
        rates: dict[int, list[float]] = {}
        for level, tokens in SWEEP_ROW.findall(block):
            rates.setdefault(int(level), []).append(float(tokens))
        cells = [CELL.findall(row) for row in PER_WINDOW.findall(block)]
        levels = sorted(rates)
        if cells and len(cells) == len(levels):
            sweeps[label] = [Level(n, tuple(max(float(t), float(i)) for t, i, _ in row), tuple(star == "*" for _, _, star in row),
                                   statistics.fmean(rates[n])) for n, row in zip(levels, cells)]
    return sweeps


def picked(levels: list[Level], keeps: Callable[[Level], bool]) -> Level | None:
    """The level a sweep picks under a rule (`Level.keeps_every_window` or `Level.keeps_reference_window`): the
    largest before the first that breaks what the rule judges."""
    best = None
    for level in levels:
        if not keeps(level):
            break
        best = level
    return best


def level_of(levels: list[Level], n: int) -> Level | None:
    """The sweep's run at `n` in flight; None where it did not run (a level below it broke)."""
    return next((lv for lv in levels if lv.in_flight == n), None)


def kept_through(levels: list[Level], n: int) -> bool:
    """`n` in flight ran and kept every window, and so did each level below it (a level not run counts as broken)."""
    return level_of(levels, n) is not None and all(lv.keeps_every_window() for lv in levels if lv.in_flight <= n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="*", type=Path, help="coserve reports (default: the matrices in benchmarks/results)")
    paths = parser.parse_args().reports or sorted(RESULTS.glob("coserve-matrix-*.txt"))
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        parser.error(f"no such report: {', '.join(missing)} (coserve.py --out FILE writes one)")
    runs: list[tuple[str, dict[str, list[Level]]]] = []
    for path in paths:
        text = path.read_text()
        sweeps = read_sweeps(text)
        if not sweeps:
            print(f"skipped (no sweep with per-window cells): {path.name}")
            continue
        idle = IDLE.search(text)
        runs.append((path.name, sweeps))
        cells = []
        for label, levels in sweeps.items():
            shown = " ".join(f"{lv.in_flight}:{max(lv.windows):.2f}{'*' if not lv.keeps_every_window() else ''}" for lv in levels)
            chosen = picked(levels, Level.keeps_every_window)
            cells.append(f"{label} {shown} -> {chosen.in_flight if chosen else 'n/a'}")
        print(f"{path.name:<58} idle {idle.group(1) if idle else '?':>4} s  " + "; ".join(cells))
    for rule, words in ((Level.keeps_reference_window, "the reference phase's window only"),
                        (Level.keeps_every_window, "every window after the first")):
        print(f"\npicked on {words}:")
        for label in SCENARIOS:
            summarize(label, [sweeps[label] for _, sweeps in runs if label in sweeps], rule)
    both = [sweeps for _, sweeps in runs if all(label in sweeps for label in SCENARIOS)]
    print(f"\neach fixed level as the batch side, over the {len(both)} runs with both sweeps: the runs in which it would meet "
          f"the issue's targets in (a) and (e) (every window kept, c >= {C_TARGET} the median over them)")
    for n in sorted({lv.in_flight for sweeps in both for levels in sweeps.values() for lv in levels}):
        shares = [as_batch_side(sweeps, n) for sweeps in both]
        met = sum(1 for c in shares if c is not None and c >= C_TARGET)
        shown = " ".join("-" if c is None else f"{c:.2f}" for c in shares)
        print(f"  fixed {n:>2}: {met}/{len(both)} runs; c per run (-: a window broken, or no level picked) {shown}")


def as_batch_side(sweeps: dict[str, list[Level]], n: int) -> float | None:
    """A fixed batch of `n` in flight judged as the batch side: None where it broke a window of (a) or (e) (or a level
    below it did) or a sweep picked no level; else its batch over the picked level's, the median over (a) and (e)."""
    shares = []
    for levels in sweeps.values():
        mine, best = level_of(levels, n), picked(levels, Level.keeps_every_window)
        if mine is None or best is None or not kept_through(levels, n):
            return None
        shares.append(mine.tokens_per_s / best.tokens_per_s)
    return statistics.median(shares)


def summarize(label: str, sweeps: list[list[Level]], rule: Callable[[Level], bool]) -> None:
    if not sweeps:
        return
    choices = [picked(levels, rule) for levels in sweeps]
    levels_picked = [c.in_flight if c else 0 for c in choices]
    print(f"{label} over {len(sweeps)} runs: picked " + ", ".join(
        f"{n or 'none'} x{levels_picked.count(n)}" for n in sorted(set(levels_picked))))
    for n in sorted({lv.in_flight for levels in sweeps for lv in levels}):
        ran = [(level_of(levels, n), choice) for levels, choice in zip(sweeps, choices)]
        reference = sum(1 for lv, _ in ran if lv is not None and lv.keeps_reference_window())
        later = sum(1 for lv, _ in ran if lv is not None and lv.keeps_later_windows())
        every = sum(1 for levels in sweeps if kept_through(levels, n))
        shares = [lv.tokens_per_s / choice.tokens_per_s for lv, choice in ran if lv is not None and choice is not None]
        rates = [lv.tokens_per_s for lv, _ in ran if lv is not None]
        share = f"{statistics.median(shares):.2f}x" if shares else "n/a"
        print(f"  fixed {n:>2}: ran in {len(rates):>2}; kept the reference window {reference:>2}, the later ones {later:>2}, every "
              f"window {every:>2} of {len(sweeps)} runs (not run: broken); batch {statistics.median(rates):5.0f} tok/s, "
              f"{share} the picked level's (median)")


if __name__ == "__main__":
    main()
