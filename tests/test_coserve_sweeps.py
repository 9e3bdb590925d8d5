"""benchmarks/coserve_sweeps.py: a report's sweeps read back, and the level each rule picks."""

from __future__ import annotations

from benchmarks.coserve_sweeps import Level, as_batch_side, picked, read_sweeps

# (a)'s sweep of benchmarks/results/coserve-matrix-2026-11-29-avx512-saturated-at-zero-run2.txt, abridged: 4 kept the
# heavy window and broke light2's (1.33x first-token); (e) is made up, its sweep broken at 1 by a window printed as
# 1.25x (over the SLO before rounding: the report's * is the verdict)
REPORT = """\
== (a) light-heavy-light on the tuned server (--max-num-seqs 128 --max-num-batched-tokens 256)
sweep1     light     20   0       67     174       18      61       53.7      0.9      0
sweep1     heavy     69   0       66     141       20      87       46.5      0.9      0
sweep1     light2    27   0       62     199       18      57       53.4      0.9      0
           per window 0.65/0.93 0.92/0.60; the heavy phase's: 1/1 kept, keeps the SLO
sweep2     light     20   0       69     167       20      70       95.5      2.0      0
sweep2     heavy     69   0       67     182       21      95       86.1      1.9      0
sweep2     light2    27   0       75     210       20      69       95.1      1.9      0
           per window 0.83/1.01 0.97/0.74; the heavy phase's: 1/1 kept, keeps the SLO
sweep4     light     20   0       72     154       21      63      182.9      3.9      0
sweep4     heavy     69   0       72     164       25     101      145.8      3.7      0
sweep4     light2    27   0       77     289       22      77      164.1      4.0      0
           per window 0.75/1.08 1.33/0.82*; the heavy phase's: 1/1 kept, keeps the SLO
sweep8     light     20   0       84     199       26     119      274.3      7.9      0
sweep8     heavy     69   0       91     188       31     132      223.9      7.6      0
sweep8     light2    27   0       75     219       28     140      252.5      7.3      0
           per window 0.86/1.41* 1.01/1.49*; the heavy phase's: 0/1 kept, breaks the SLO
           best safe fixed concurrency: 4

per window (p99 over alone's heaviest p99, TTFT/ITL; * breaks the SLO; then the batch requests the server ran):
oracle4      0.75/1.08   1.33/0.82*     3.7   4.0

== (e) untuned on the untuned server (no tuning flags)
sweep1     light     20   0       67     174       18      61       50.0      0.9      0
sweep1     heavy     69   0       66     141       20      87       40.0      0.9      0
sweep1     light2    27   0       62     199       18      57       60.0      0.9      0
           per window 1.02/1.25* 0.92/0.60; 1/2 kept, breaks the SLO
           best safe fixed concurrency: none (even 1 in flight breaks the SLO)

== guard log, a-light-heavy-light
           per window 9.99/9.99 9.99/9.99; a guard log line that is no sweep's
"""


def test_each_level_is_read_with_its_windows_and_its_batch_rate() -> None:
    sweeps = read_sweeps(REPORT)
    assert [(lv.in_flight, lv.windows, lv.broken) for lv in sweeps["(a)"]] == [
        (1, (0.93, 0.92), (False, False)), (2, (1.01, 0.97), (False, False)), (4, (1.08, 1.33), (False, True)),
        (8, (1.41, 1.49), (True, True))]
    assert sweeps["(a)"][2].tokens_per_s == (182.9 + 145.8 + 164.1) / 3
    assert [(lv.in_flight, lv.windows, lv.broken) for lv in sweeps["(e)"]] == [(1, (1.25, 0.92), (True, False))]


def test_the_reference_rule_picks_a_level_that_broke_a_later_window_and_every_window_does_not() -> None:
    sweeps = read_sweeps(REPORT)
    reference, every = picked(sweeps["(a)"], Level.keeps_reference_window), picked(sweeps["(a)"], Level.keeps_every_window)
    assert reference is not None and reference.in_flight == 4
    assert every is not None and every.in_flight == 2
    assert picked(sweeps["(e)"], Level.keeps_every_window) is None and picked(sweeps["(e)"], Level.keeps_reference_window) is None


def test_a_fixed_level_as_the_batch_side_is_judged_on_every_window_against_each_picked_level() -> None:
    def level(n: int, tokens: float, *broken: bool) -> Level:
        return Level(n, tuple(1.3 if b else 1.0 for b in broken), broken, tokens)

    a = [level(1, 50, False, False), level(2, 100, False, False), level(4, 160, False, True)]  # picks 2
    e = [level(1, 50, False, False), level(2, 90, True, False)]  # picks 1
    assert as_batch_side({"(a)": a, "(e)": e}, 1) == (0.5 + 1.0) / 2
    assert as_batch_side({"(a)": a, "(e)": e}, 2) is None  # it broke (e)'s heavy window
    assert as_batch_side({"(a)": a, "(e)": a}, 4) is None  # it broke a later window
    assert as_batch_side({"(a)": a, "(e)": e[:1] + [level(2, 90, False, False)]}, 2) == (1.0 + 1.0) / 2
