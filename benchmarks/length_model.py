"""The per-request length model on real outputs of the embedded model (smollm2-135m, greedy,
max_tokens 256): how well it ranks a set's answers, how close it gets a new set's mean
length, and how fast it predicts.

    .venv/bin/python benchmarks/length_model.py        (~5 minutes alone on 2 cores; no engine)

Data: benchmarks/data/length_sets.parquet, five prompt sets of different kinds written by
benchmarks/length_sets.py (run that first if the file is missing; it needs the engine).
Per set:
  tau          Kendall tau between predicted shift and actual length, the model fit on a
               random half of the set and tested on the other half (cut outputs count at
               their cap: a tie-aware rank of what was seen)
  halves       the same over HALVES random halves: mean (lowest-highest), how much one
               half's tau is luck
  tokens       prompt tokens alone as the ranking, mean over the same halves: what a set
               ranks on without its content
  new set      the set as never seen: fit on the other four sets only, then the error of the
               predicted mean (capped) length of the set's rows outside the pilot:
                 cdf      the per-model CDF (Kaplan-Meier of the other sets' lengths), shift 0
                 model    the length model alone, as for a new set (LengthModel.for_new_set:
                          the share k of each shift that carried over to held-out training
                          sets, on their residual base; k is printed)
                 +pilot   with a pilot of the set (0.5 % of its rows, at least 64, at most
                          2,000): the length model refit with the pilot's outputs added, then
                          its level set so its expected capped mean over the pilot is the
                          pilot's (the AFT scale of the new set, given the model's shifts)
                 pilot    the pilot's own Kaplan-Meier distribution, for reference
               pilot figures: mean |error| over PILOT_DRAWS random pilots (and the worst draw)
  gate         the gate's verdict for the set as new (held-out scores: model vs CDF)
Then predictions per second on one core (the process pinned to one CPU; features and
shifts of 20,000 prompts in one call), per CPU second of the process (the machine is shared,
so wall time also counts other jobs' turns) and per wall second.
Targets: median tau >= 0.4 and none below 0.2; +pilot within 10 % on every set; the model
alone no worse than the CDF on a new set; >= 10,000 predictions/s.
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from scipy.stats import kendalltau  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from batchllm.core.length_prompt import LengthPrompt  # noqa: E402
from batchllm.costmodel.length_model.gate import gate  # noqa: E402
from batchllm.costmodel.length_model.model import LengthModel  # noqa: E402
from batchllm.costmodel.lengths import LengthDistribution  # noqa: E402
from batchllm.costmodel.request_lengths import RequestLengths  # noqa: E402

DATA = REPO / "benchmarks" / "data" / "length_sets.parquet"
PILOT_DRAWS = 10
HALVES = 10


def pilot_size(rows: int) -> int:
    return min(max(round(0.005 * rows), 64), 2000)


def load() -> dict[str, tuple[list[LengthPrompt], np.ndarray, np.ndarray]]:
    sets: dict[str, tuple[list, list, list]] = {}
    for r in pq.read_table(DATA).to_pylist():
        prompts, lengths, finished = sets.setdefault(r["set"], ([], [], []))
        prompts.append(LengthPrompt(r["last_user"], r["system"], r["template"], r["prompt_tokens"], r["max_tokens"],
                                    r["temperature"], r["history_chars"]))
        lengths.append(r["output_tokens"])
        finished.append(r["finished"])
    return {name: (p, np.asarray(l, np.int64), np.asarray(f, bool)) for name, (p, l, f) in sets.items()}


def take(data, rows):
    prompts, lengths, finished = data
    return [prompts[i] for i in rows], lengths[rows], finished[rows]


def capped_mean(lengths: RequestLengths, prompts: list[LengthPrompt]) -> float:
    return float(np.mean(lengths.expected(np.array([p.max_tokens for p in prompts], float))))


def with_pilot_of(model: LengthModel, prompts, lengths, finished, pilot_prompts, pilot_lengths,
                  pilot_finished) -> LengthModel:
    """The model refit with the pilot's outputs among its training outputs (the pilot's own
    words and template), then its level set by the pilot (LengthModel.scaled_to)."""
    refit = LengthModel.fit(prompts + pilot_prompts, np.concatenate([lengths, pilot_lengths]),
                            np.concatenate([finished, pilot_finished]), alpha=model.alpha)
    return refit.scaled_to(pilot_prompts, pilot_lengths)


def split_taus(data, seed: int) -> tuple[float, float]:
    """Kendall tau of the model fit on a random half (drawn from `seed`) against the other half,
    and of prompt tokens alone on that other half."""
    prompts, lengths, _ = data
    order = np.random.default_rng(seed).permutation(len(prompts))
    train, test = order[: len(prompts) // 2], order[len(prompts) // 2:]
    test_prompts = take(data, test)[0]
    model_tau = float(kendalltau(LengthModel.fit(*take(data, train)).log_shift(test_prompts), lengths[test]).statistic)
    return model_tau, float(kendalltau([p.prompt_tokens for p in test_prompts], lengths[test]).statistic)


def main() -> int:
    if not DATA.exists():
        raise SystemExit(f"{DATA} is missing: run benchmarks/length_sets.py first (it needs the engine)")
    sets = load()
    print(f"{sum(len(s[0]) for s in sets.values()):,} outputs of smollm2-135m (greedy, max_tokens 256) in {len(sets)} sets")
    print(f"{'set':13} {'rows':>5} {'mean':>5} {'cut':>4} {'tau':>6} {'halves':>18} {'tokens':>6} | new set, mean length error: {'cdf':>7} {'model':>7} "
          f"{'+pilot':>7} {'worst':>7} {'pilot':>7} | gate (model vs cdf log error), k")
    taus, with_pilot, ratios, transfers = {}, {}, {}, {}
    for name, data in sets.items():
        prompts, lengths, finished = data
        count = len(prompts)
        taus[name] = split_taus(data, 0)[0]
        model_taus, token_taus = zip(*(split_taus(data, 1000 + draw) for draw in range(HALVES)))
        halves = f"{np.mean(model_taus):.2f} ({min(model_taus):.2f}-{max(model_taus):.2f})"

        others = [s for s in sets if s != name]
        pooled = tuple(zip(*[sets[s] for s in others]))
        train_prompts = [p for ps in pooled[0] for p in ps]
        train_lengths, train_finished = np.concatenate(pooled[1]), np.concatenate(pooled[2])
        groups = [s for s in others for _ in sets[s][0]]
        model = LengthModel.fit(train_prompts, train_lengths, train_finished, groups=groups)
        new_set = model.for_new_set()
        cdf = LengthDistribution.fit(train_lengths, train_finished)
        size = pilot_size(count)
        errors = {"cdf": [], "model": [], "+pilot": [], "pilot": []}
        for draw in range(PILOT_DRAWS):
            order = np.random.default_rng(100 + draw).permutation(count)
            pilot, rest = order[:size], order[size:]
            rest_prompts, rest_lengths, _ = take(data, rest)
            actual = float(rest_lengths.mean())
            pilot_prompts, pilot_lengths, pilot_finished = take(data, pilot)
            predicted = {
                "cdf": capped_mean(RequestLengths.shared(cdf, len(rest), "prior"), rest_prompts),
                "model": capped_mean(new_set.request_lengths(rest_prompts), rest_prompts),
                "+pilot": capped_mean(with_pilot_of(model, train_prompts, train_lengths, train_finished, pilot_prompts,
                                                    pilot_lengths, pilot_finished).request_lengths(rest_prompts, "pilot"),
                                      rest_prompts),
                "pilot": capped_mean(RequestLengths.shared(LengthDistribution.fit(pilot_lengths, pilot_finished), len(rest),
                                                           "pilot"), rest_prompts),
            }
            for key, value in predicted.items():
                errors[key].append(abs(value - actual) / actual)
        verdict = gate(new_set, cdf, prompts, lengths, finished)
        transfers[name] = model.new_set.transfer if model.new_set else 1.0
        mean = {key: float(np.mean(values)) for key, values in errors.items()}
        with_pilot[name], ratios[name] = mean["+pilot"], mean["model"] / mean["cdf"]
        print(f"{name:13} {count:5} {lengths.mean():5.0f} {(~finished).mean():4.0%} {taus[name]:6.3f} {halves:>18} "
              f"{np.mean(token_taus):6.2f} | "
              f"{'':27} {mean['cdf']:7.1%} {mean['model']:7.1%} {mean['+pilot']:7.1%} {max(errors['+pilot']):7.1%} "
              f"{mean['pilot']:7.1%} | {'use' if verdict.use else 'keep cdf'} ({verdict.model_score:.3f} vs "
              f"{verdict.cdf_score:.3f}), k {transfers[name]:.1f}", flush=True)
    print(f"pilot: {pilot_size(350)} rows per set (0.5 % of the rows, at least 64, at most 2,000); "
          f"errors are the mean |error| over {PILOT_DRAWS} random pilots ('worst': the largest of them)")

    everything = [p for data in sets.values() for p in data[0]]
    model = LengthModel.fit(everything, np.concatenate([d[1] for d in sets.values()]),
                            np.concatenate([d[2] for d in sets.values()]))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    model.log_shift(everything[:500])  # warm
    speeds = {}
    for label, pool in (("the five sets", everything), ("sharegpt only", sets["sharegpt"][0] if "sharegpt" in sets else everything)):
        many = [pool[i % len(pool)] for i in range(20_000)]
        cpu_s = wall_s = float("inf")
        for _ in range(3):
            wall, cpu = time.perf_counter(), time.process_time()
            model.log_shift(many)
            wall_s, cpu_s = min(wall_s, time.perf_counter() - wall), min(cpu_s, time.process_time() - cpu)
        speeds[label] = len(many) / cpu_s
        print(f"prediction speed on one core, {label}: {len(many) / cpu_s:,.0f} predictions per CPU second "
              f"({len(many) / wall_s:,.0f}/s wall; {len(many):,} prompts in one call, best of 3; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    speed = speeds["the five sets"]
    worst_tau = min(taus.values())
    print(f"worst: tau {worst_tau:.2f} (median {statistics.median(taus.values()):.2f}), new-set mean error "
          f"{100 * max(with_pilot.values()):.1f} % with pilot, {max(ratios.values()):.2f}x the CDF's without, "
          f"{speed:,.0f} predictions/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
