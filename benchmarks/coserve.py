"""A batch beside an online service on one shared vLLM server: does the online traffic keep
its latency, and how much batch work gets done? Over a matrix of online loads and servers.

    .venv/bin/python benchmarks/coserve.py [--scenarios a,b,c,d,e] [--quick] [--phase-s S] [--slo-margin 1.25] [--port 8431] [--out FILE]

One real vLLM OpenAI server (`python -m vllm.entrypoints.openai.api_server`, priority
scheduling) serves the embedded model (smollm2-135m) on ONE core (`--server-core`, default 0).
This process, the batch clients and batchllm run on the other core (`--client-core`, default
1). Everything talks over 127.0.0.1.

Scenarios (`--scenarios`, letters or names, default all five), run back to back, each with
its own alone side; the scenarios of one server configuration share one start of it (the
tuned server for a-d, then the untuned one for e):

    a  light-heavy-light  tuned server; online light, heavy, light again (`--phase-s` each)
    b  saturated          tuned; a population of clients in a closed loop at which alone's
                          inter-token p50 is >= 10x idle
    c  long-answers       tuned; every answer longer than the guard's 10 s window, a low rate
    d  bursts             tuned; the light rate, and 10x it for 5 s in the middle of every window
    e  untuned            a server with no tuning flags (vLLM's prefill chunk of 2048 tokens on
                          CPUs, its max_num_seqs of 128): light-heavy-light as in a

The tuned server prefills in chunks of CHUNK_TOKENS a step (`--max-num-batched-tokens`) and
runs `--max-num-seqs` (128 = vLLM's CPU default) at once. With vLLM's CPU default chunk of
2048, one long batch prompt's prefill stalls every online request decoding beside it for that
step: in a quick run on a loaded machine, one batch request in flight took the heavy-phase ITL
p99 from 0.20 s (alone) to 1.6 s, so no batch at all would keep the SLO there (scenario e).

Sizing: no load is a fixed number of requests/s; each is sized from what the server shows, so
the matrix keeps its meaning on a host 10-15x slower (AVX-512+BF16 or AVX2 only: nothing
assumed). After its warm-up each server answers IDLE_REQUESTS lone online requests, one after
another: the idle TTFT p50, inter-token p50 and request time (p50, send to last token).

    a, d, e  rates are loads over the idle request time: a load is the online requests in
             flight if each took its idle time. Light LIGHT_LOAD (0.8), heavy HEAVY_LOAD (2.4):
             about the former fixed 1 and 3 requests/s on the 2-core AVX2 machine of
             benchmarks/results (0.8 s a lone request). Bursts (d): BURST_FACTOR (10) x light
             for BURST_S (5 s) in the middle of every window, light otherwise.
    b        a closed loop: a population of clients, each sending its next request as soon as its
             last one ended (joining one by one over the ramp window). The smallest probed population
             whose alone inter-token p50 is >= SATURATION_FACTOR (10) x idle: probes of online load
             alone, each max(PROBE_MIN_S (20 s; --quick 10 s), PROBE_REQUESTS (20) idle request times)
             long, the p50 over its second half; from SATURATION_START_CLIENTS (16) up 2x a probe until
             one reaches it (at most SATURATION_PROBES, 6), then SATURATION_SPLITS (2) probes halving
             that last step. If none reaches it, the largest probed, said so. The probes and the
             choice are printed. (Until 2026-11-29 an open-loop Poisson rate: at the rate this
             criterion asks the server is at its capacity, its queue random-walks through the phases,
             and alone run twice differed by up to 1.31x in first-token p99: more than the margin.)
    c        max_tokens = ceil(LONG_ANSWER_S (15 s) / idle inter-token p50), within 64-4,096,
             and each answer runs to it (`ignore_eos`): over 10 s even at the idle pace; rate
             LONG_LOAD (3.0) over the idle time of such an answer (about 3 in flight, 0.2/s
             at 15 s an answer).

Phases: a and e three of `--phase-s` (60 s when a single scenario runs, as before the matrix;
one window, 30 s, in a matrix run; --quick 15 s). b and c a ramp window then two steady
windows; d three windows, a burst in each. Reference: alone's p99 over the scenario's
reference phases: heavy (a, e), steady (b, c), the bursts pooled (d).

Online load (this process, async httpx): streamed chat completions at priority 0, Poisson
arrivals of real chat prompts (ShareGPT first turns of at most 1,000 characters, from
profiles/prompts/first_turns.parquet), max_tokens 32-64 (c: above), greedy. The arrival
times and prompts come from `--seed` and are the same for every side of a scenario. Each
request measures its own time to first token (TTFT: send to the first chunk carrying tokens)
and inter-token latency (ITL: the gap before each later chunk, split evenly over the tokens it
carries; `return_token_ids` gives the count, logprobs would slow the server).

Batch work: other ShareGPT first turns of 20-1,000 characters (none of the online ones), shuffled, one
Parquet file for every batch side, max_tokens 128, greedy, priority 1 (vLLM runs lower
values first: batch after online). The sides of a scenario, one after another on the same
server, each started from scratch beside the same online load (prefix cache reset and server
idle between sides); a and e run every side of `--sides`, b-d alone and batchllm only:

    alone      no batch: the reference. SLO = 1.25 x (`--slo-margin`) its p99 TTFT and ITL over the reference
               phases, or over a judged window of its own where that was heavier (the heaviest
               alone latency, one bound for every phase and window: alone keeps it by construction)
    fixed      a plain HTTP batch client (non-streamed) at the server's max_num_seqs
    sweep      the fixed client at 1, 2, 4, 8 ... in flight over all phases until one breaks the
               SLO in a window after the first (30 s windows, the rule batchllm is held to); the
               largest that kept them all is
    oracle     the best safe fixed concurrency, a number no user has (its sweep run)
    batchllm   `batchllm run DAG --out DIR` whose DAG names the server under `endpoints:`
               with the SLO; SIGINT at the end of the last phase
    again      (only when named in `--sides`) alone once more, last: its worst window over the
               first alone's is how far alone differs from itself, the noise under every ratio

A batch side starts first; the phases begin once the server runs its requests. Batch output
tokens/s per phase is measured the same way for every side: the server's
`vllm:generation_tokens_total` (/metrics, scraped at the phase bounds) over the phase,
minus the online generator's own tokens received in it.

Printed per scenario: its sizing and phases; per side and phase the online requests (and
errors), p50/p99 TTFT and ITL, batch tokens/s, the mean number of batch requests the server
ran (its running gauge less the online requests between their first and last token) and
preemptions; per side the worst `--window-s` (30 s) window after the first against the SLO;
the sweep; the scenario's line `(a) light-heavy-light: online p99 TTFT ...x, inter-token ...x
of alone (worst window)[; batch ...x the best safe fixed concurrency; fixed client ...]`. The
alone side's batch tokens/s (not clipped at 0) is the error of the method (0.0 in the smoke
runs). Then the matrix: per scenario batchllm's worst-window ratios, windows kept, batch
tokens/s and (a, e) its batch over the oracle's; the targets (online p99 TTFT and inter-token
<= 1.25x alone in every scenario's worst window, batch >= 1.0x the best safe fixed concurrency,
the median over a and e); the total runtime; and last:

    worst scenario: online p99 TTFT <a>x, inter-token <b>x of alone; batch <c>x the best safe fixed concurrency (median over (a), (e))

<a>, <b>: the largest worst-window ratio over the scenarios; <c>: the median over a and e of
batchllm's batch tokens/s over the oracle's (n/a where none was safe or nothing ran).

Run time (the plan is printed at the start, the runtime per scenario and in total at the
end), about, with the default sides and 30 s phases, if a sweep stops by 4 in flight: a 12
min, b 9 min (6 probes of 20 s), c 5 min, d 4 min, e 12 min (with vLLM's chunk of 2048 the
sweep usually stops at 1 in flight: 8 min), plus 1 min per server start: about 41 min for
the matrix on any host (phases are wall time; probes and drains are what a slower host
lengthens), up to an hour only if both sweeps ran to 128 in flight. A single (a) run, 60 s
phases: about 21 min. `--quick` is a smoke run (15 s phases, 10 s windows, sweep 1, 2, 4,
10 s probes: about 25 min for the matrix). `--out` also writes the report to a file,
otherwise only stdout. `--keep` keeps the work folder (server and batch logs, the DAGs,
batchllm's --out, one folder per scenario).

Internal: `coserve.py fixed-client ...` is the fixed client's own process (started by the
benchmark, like batchllm: a separate process, SIGINT to stop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import median

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from batchllm.core.latency_slo import BASELINE_MARGIN, LatencySlo  # noqa: E402
from batchllm.engines.endpoint.latency_window import server_latency  # noqa: E402
from batchllm.engines.endpoint.server_metrics import MetricsSnapshot, parse_metrics  # noqa: E402

MODEL = "smollm2-135m"
PROMPTS = REPO / "profiles" / "prompts"
ONLINE_POOL = 200  # chat prompts the online load draws from
ONLINE_MAX_TOKENS = (32, 64)
BATCH_MAX_TOKENS = 128
ONLINE_PRIORITY, BATCH_PRIORITY = 0, 1  # vLLM's priority scheduling runs lower values first
MAX_NUM_SEQS = 128  # vLLM's default for the OpenAI server on CPUs
KV_CACHE_BYTES = 1_000_000_000
CHUNK_TOKENS = 256  # the server's prefill chunk: a step of a long batch prompt stays short beside online decodes
SCRAPE_EVERY_S = 2.0
LAG_PROBE_EVERY_S = 0.01  # the load generator's own event loop: how late a sleep of this length wakes
REQUEST_TIMEOUT_S = 300.0
SERVER_START_TIMEOUT_S = 240.0
BATCH_START_TIMEOUT_S = 300.0  # batchllm imports, reads the DAG and plans before its first request
STOP_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 120.0

# Sizing the online loads from what the server shows (the module docstring): loads are online requests in flight if
# each took its idle time, rates are loads over the idle request time.
IDLE_REQUESTS = 8  # lone online requests, one after another, after a server's warm-up
LIGHT_LOAD, HEAVY_LOAD = 0.8, 2.4  # about the former 1 and 3 requests/s at 0.8 s a lone request
BURST_FACTOR, BURST_S = 10.0, 5.0  # bursts: 10x the light rate for 5 s, once a window
LONG_ANSWER_S = 15.0  # long answers: each longer than the guard's 10 s window even at the idle pace
LONG_ANSWER_TOKENS = (ONLINE_MAX_TOKENS[1], 4096)  # the bounds of their max_tokens (the model holds 8,192)
LONG_LOAD = 3.0  # long answers in flight at the idle pace: about 6 sent a 30 s window, a low rate
SATURATION_FACTOR = 10.0  # saturated: alone's inter-token p50 at least this many times the idle one
# (b)'s population: from 16 clients, doubled a probe until one reaches it (at most 6: 512), then the last step halved twice
SATURATION_START_CLIENTS, SATURATION_STEP, SATURATION_PROBES, SATURATION_SPLITS = 16, 2.0, 6, 2
PROBE_MIN_S, PROBE_REQUESTS = 20.0, 20  # a probe: max(20 s (--quick: 10 s), 20 idle request times)
ORACLE_TARGET = 1.0  # the matrix's target: batchllm's batch >= the best safe fixed concurrency's (median over a, e)
# The plan's guesses (seconds): a server's start, warm-up and idle probe; a side's start, drain and reset beyond its
# phases; batchllm's own start; the saturation probes a run usually takes
SERVER_SETUP_S, SIDE_OVERHEAD_S, BATCHLLM_START_S, LIKELY_PROBES = 60.0, 20.0, 30.0, 6


@dataclass(frozen=True)
class Phase:
    name: str
    rate: float  # online requests per second
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt: str
    max_tokens: int
    ignore_eos: bool = False  # answer up to max_tokens (long answers)


@dataclass(frozen=True)
class ClosedLoop:
    """(b)'s online load: a fixed population of clients, each sending its next request as soon as its last one ended,
    joining one by one over `join_s`. An open-loop rate at a server's capacity has no steady state (its queue
    random-walks: alone run twice differed by 1.31x in first-token p99); a population keeps the server as full, and
    what a batch adds shows as what it is."""

    clients: int
    join_s: float  # the last client joins here (the ramp)
    end_s: float  # no client sends after this
    pool: tuple[str, ...]
    seed: int
    max_tokens: tuple[int, int] = ONLINE_MAX_TOKENS


OnlineLoad = list[Arrival] | ClosedLoop  # Poisson arrivals at the phases' rates, or (b)'s population


@dataclass(frozen=True)
class Server:
    """A server configuration: the scenarios that share one run on one start of it."""

    name: str
    max_num_seqs: int | None = None  # None: no flag, vLLM's default (MAX_NUM_SEQS on CPUs)
    max_num_batched_tokens: int | None = None  # None: no flag, vLLM's default prefill chunk (2048 on CPUs)

    @property
    def seqs(self) -> int:
        return self.max_num_seqs or MAX_NUM_SEQS

    def describe(self) -> str:
        flags = " ".join(tuning_flags(self.max_num_seqs, self.max_num_batched_tokens))
        return f"{self.name} server ({flags or 'no tuning flags'})"


def tuning_flags(max_num_seqs: int | None, max_num_batched_tokens: int | None) -> list[str]:
    """The server's tuning flags; a value of None (or 0) leaves vLLM's default."""
    flags = ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []
    return flags + (["--max-num-batched-tokens", str(max_num_batched_tokens)] if max_num_batched_tokens else [])


# What a scenario's load unit is (its rates are multiples of it), and the shape of its phases
IDLE_REQUEST, LONG_ANSWER, SATURATING = "1 / the idle request time", "1 / the idle long-answer time", "the saturating population"
THREE_PHASES, STEADY, BURSTS = "light-heavy-light", "steady", "bursts"


@dataclass(frozen=True)
class Scenario:
    """One load on one server of the matrix: its phases' rates are its loads times a unit measured on the server."""

    key: str  # its letter, for --scenarios
    name: str
    server: Server
    unit: str  # what its loads are multiples of: IDLE_REQUEST, LONG_ANSWER or SATURATING
    shape: str  # THREE_PHASES (of --phase-s), STEADY (a ramp window, two steady ones), BURSTS (a burst in each of 3 windows)
    loads: tuple[float, ...]  # in units: (light, heavy), (steady,) or (light,)
    reference: str  # alone's phases whose pooled p99 is the reference (their name without its number)
    oracle: bool  # also the fixed client and the sweep, the best safe fixed concurrency

    @property
    def label(self) -> str:
        return f"({self.key}) {self.name}"


def make_scenarios(tuned: Server, light: float = LIGHT_LOAD, heavy: float = HEAVY_LOAD) -> list[Scenario]:
    """The matrix: a-d on the tuned server, e on one with vLLM's defaults."""
    untuned = Server("untuned")
    return [Scenario("a", "light-heavy-light", tuned, IDLE_REQUEST, THREE_PHASES, (light, heavy), "heavy", True),
            Scenario("b", "saturated", tuned, SATURATING, STEADY, (1.0,), "steady", False),
            Scenario("c", "long-answers", tuned, LONG_ANSWER, STEADY, (LONG_LOAD,), "steady", False),
            Scenario("d", "bursts", tuned, IDLE_REQUEST, BURSTS, (light,), "burst", False),
            Scenario("e", "untuned", untuned, IDLE_REQUEST, THREE_PHASES, (light, heavy), "heavy", True)]


def by_server(scenarios: list[Scenario]) -> list[tuple[Server, list[Scenario]]]:
    """The scenarios grouped by their server, in the order each server first comes: one start per server."""
    groups: dict[Server, list[Scenario]] = {}
    for scenario in scenarios:
        groups.setdefault(scenario.server, []).append(scenario)
    return list(groups.items())


@dataclass(frozen=True)
class Idle:
    """A server's lone online requests, one after another: p50s."""

    ttft_s: float
    itl_s: float
    request_s: float  # send to last token


@dataclass(frozen=True)
class Load:
    """A scenario's online load as sized on its server."""

    unit_rate: float  # requests/s of one unit of its loads (0 with a population)
    max_tokens: tuple[int, int]
    ignore_eos: bool
    how: str  # for the report
    clients: int = 0  # (b): a closed loop of this many clients (ClosedLoop); 0: Poisson arrivals at the rates

    def online(self, phases: list[Phase], pool: list[str], seed: int) -> OnlineLoad:
        """What the online generator sends over the phases: the population joining over the first phase, or arrivals."""
        if self.clients:
            return ClosedLoop(self.clients, phases[0].end_s, phases[-1].end_s, tuple(pool), seed, self.max_tokens)
        return make_arrivals(phases, pool, seed, self.max_tokens, self.ignore_eos)


@dataclass(frozen=True)
class ScenarioResult:
    """What the matrix reports of a scenario: batchllm's worst window (None: no batchllm side) and its batch over the
    oracle's (None: no oracle, or none was safe)."""

    scenario: Scenario  # with a sweep (a, e), its gain counts in the median
    ttft: float | None = None  # worst window's p99 over alone's reference p99
    itl: float | None = None
    kept: int = 0
    windows: int = 0
    batch_tps: float | None = None
    gain: float | None = None
    seconds: float = 0.0


@dataclass
class OnlineResult:
    sent_s: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (received at, tokens in the chunk)
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] - self.sent_s if self.chunks else None


@dataclass
class SideRun:
    name: str
    phases: list[Phase]
    online: list[OnlineResult]
    scrapes: list[tuple[float, MetricsSnapshot]]  # (seconds since the phases began, what the server showed)
    bounds: list[tuple[float, MetricsSnapshot]]  # the scrapes at the phase bounds
    loop_lags: list[tuple[float, float]] = field(default_factory=list)  # (at, seconds a probe woke late): the client's own delay
    note: str = ""


# ---------------------------------------------------------------- prompts and arrivals

def load_prompts(seed: int) -> tuple[list[str], list[str]]:
    """Online chat prompts and batch prompts: both ShareGPT first turns of 20-1,000 characters (the batch is
    a data set of the same chat requests, run offline), none in both, shuffled. Long prompts (multi-turn, whole
    documents) would make the batch's prefill, not its decoding, what the online traffic feels."""
    first = pq.read_table(PROMPTS / "first_turns.parquet").column("prompt").to_pylist()
    rng = np.random.default_rng(seed)
    chat = [i for i, p in enumerate(first) if 20 <= len(p) <= 1000]
    online_ids = set(rng.choice(chat, ONLINE_POOL, replace=False).tolist())
    online = [first[i] for i in sorted(online_ids)]
    rest = [first[i] for i in chat if i not in online_ids]
    return online, [rest[i] for i in rng.permutation(len(rest))]


def write_batch_input(folder: Path, prompts: list[str], rows: int) -> Path:
    """The batch rows every batch side reads; copies (marked in front, no shared prefix) only if more rows are needed."""
    texts = [prompts[i % len(prompts)] if i < len(prompts) else f"(#{i // len(prompts)}) {prompts[i % len(prompts)]}"
             for i in range(max(rows, len(prompts)))]
    path = folder / "batch.parquet"
    pq.write_table(pa.table({"id": [f"b{i:05d}" for i in range(len(texts))], "prompt": texts}), path)
    return path


def make_phases(phase_s: float, light: float, heavy: float) -> list[Phase]:
    return [Phase(name, rate, k * phase_s, (k + 1) * phase_s)
            for k, (name, rate) in enumerate([("light", light), ("heavy", heavy), ("light2", light)])]


def burst_phases(periods: int, period_s: float, rate: float, burst_s: float = BURST_S,
                 factor: float = BURST_FACTOR) -> list[Phase]:
    """`rate`, and `factor` x it for `burst_s` in the middle of each of `periods` periods: light1, burst1, light2, ..."""
    phases, at = [], 0.0
    for k in range(periods):
        lo = k * period_s + (period_s - burst_s) / 2
        phases += [Phase(f"light{k + 1}", rate, at, lo), Phase(f"burst{k + 1}", rate * factor, lo, lo + burst_s)]
        at = lo + burst_s
    return phases + [Phase(f"light{periods + 1}", rate, at, periods * period_s)]


def scenario_phases(scenario: Scenario, unit_rate: float, phase_s: float, window_s: float) -> list[Phase]:
    """A scenario's phases at its loads times unit_rate requests/s."""
    rates = [load * unit_rate for load in scenario.loads]
    if scenario.shape == THREE_PHASES:
        return make_phases(phase_s, *rates)
    if scenario.shape == BURSTS:
        return burst_phases(3, window_s, rates[0])
    return [Phase("ramp", rates[0], 0.0, window_s), Phase("steady", rates[0], window_s, 3 * window_s)]


def phase_kind(name: str) -> str:
    """A phase's name without its number: light2 and light are both light."""
    return name.rstrip("0123456789")


def make_arrivals(phases: list[Phase], pool: list[str], seed: int, max_tokens: tuple[int, int] = ONLINE_MAX_TOKENS,
                  ignore_eos: bool = False) -> list[Arrival]:
    """Poisson arrivals per phase; the same seed gives the same requests at the same times."""
    rng = np.random.default_rng(seed)
    arrivals = []
    for phase in phases:
        at = phase.start_s
        while (at := at + rng.exponential(1.0 / phase.rate)) < phase.end_s:
            arrivals.append(Arrival(at, pool[int(rng.integers(len(pool)))], int(rng.integers(max_tokens[0], max_tokens[1] + 1)),
                                    ignore_eos))
    return arrivals


# ---------------------------------------------------------------- sizing rules

def idle_of(results: list[OnlineResult]) -> Idle:
    """p50s of lone requests (those answered)."""
    done = [r for r in results if r.chunks and not r.error]
    itl = pct(np.array(itl_samples(done, 0.0, math.inf)), 50)
    if not done or itl != itl:
        raise RuntimeError("the lone requests got no answer of two tokens or more: no idle inter-token latency")
    return Idle(float(np.median([r.chunks[0][0] - r.sent_s for r in done])), itl,
                float(np.median([r.chunks[-1][0] - r.sent_s for r in done])))


def long_answer_tokens(idle_itl_s: float) -> int:
    """max_tokens of a long answer: LONG_ANSWER_S at the idle inter-token p50, within LONG_ANSWER_TOKENS."""
    low, high = LONG_ANSWER_TOKENS
    return min(high, max(low, math.ceil(LONG_ANSWER_S / idle_itl_s)))


def long_answer_s(idle: Idle, tokens: int) -> float:
    """How long a long answer of `tokens` takes on the idle server."""
    return idle.ttft_s + (tokens - 1) * idle.itl_s


def saturating_rate(itl_at: Callable[[float], float], start: float, target_s: float, step: float = SATURATION_STEP,
                    probes: int = SATURATION_PROBES, splits: int = SATURATION_SPLITS) -> tuple[float, bool]:
    """The smallest probed rate whose inter-token p50 (itl_at(rate), a probe) reaches target_s: from `start` up by `step`
    until one does (at most `probes`), then `splits` probes halving that last step (geometric middles); (the rate, True).
    (the highest probed, False) when none reached it."""
    tried: dict[float, float] = {}
    rate = start
    while len(tried) < probes:
        tried[rate] = itl_at(rate)
        if tried[rate] >= target_s:
            break
        rate *= step
    else:
        return max(tried), False
    if len(tried) > 1:
        low, high = rate / step, rate
        for _ in range(splits):
            middle = math.sqrt(low * high)
            tried[middle] = itl_at(middle)
            low, high = (low, middle) if tried[middle] >= target_s else (middle, high)
    return min(r for r, itl in tried.items() if itl >= target_s), True


# ---------------------------------------------------------------- processes

def stop_process(proc: subprocess.Popen | None, first: signal.Signals | None, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
    """Signal the process group we started (`first`: SIGINT/SIGTERM, None: already sent), SIGKILL after timeout_s; its
    exit code."""
    if proc is None:
        return None
    if proc.poll() is None:
        try:
            if first is not None:
                os.killpg(proc.pid, first)
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except ProcessLookupError:
            pass
    return proc.returncode


def start_server(model_dir: Path, port: int, core: int, max_num_seqs: int | None, log: Path,
                 max_num_batched_tokens: int | None = None) -> subprocess.Popen:
    """The server on `core`; max_num_seqs and max_num_batched_tokens None: vLLM's defaults (no flag)."""
    from batchllm.engines.devices import engine_dtype

    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1",
           "VLLM_SERVER_DEV_MODE": "1"}  # dev mode: POST /reset_prefix_cache between sides
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name", MODEL,
               "--enforce-eager", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--scheduling-policy", "priority",
               "--host", "127.0.0.1", "--port", str(port), "--seed", "0", "--disable-uvicorn-access-log",
               *tuning_flags(max_num_seqs, max_num_batched_tokens)]
    dtype = engine_dtype("cpu")
    if dtype:
        command += ["--dtype", dtype]
    with open(log, "w") as handle:
        return subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def wait_healthy(base: str, proc: subprocess.Popen, log: Path, timeout_s: float = SERVER_START_TIMEOUT_S) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) while starting:\n{tail(log)}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"no /health 200 after {timeout_s:.0f} s:\n{tail(log)}")


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def warm_up(base: str, online: list[str], batch: list[str]) -> None:
    """First requests on a fresh CPU engine are slow: a few of both kinds before anything is measured."""
    async def go() -> None:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            for prompt in online[:3]:
                await client.post(f"{base}/v1/chat/completions", json=chat_body(prompt, 16, ONLINE_PRIORITY))
            await asyncio.gather(*[client.post(f"{base}/v1/chat/completions", json=chat_body(p, 16, BATCH_PRIORITY))
                                   for p in batch[:8]])
    asyncio.run(go())


def measure_idle(base: str, pool: list[str], seed: int) -> Idle:
    """IDLE_REQUESTS lone online requests, one after another, drawn from the pool as the online load draws them."""
    rng = np.random.default_rng(seed)
    low, high = ONLINE_MAX_TOKENS
    arrivals = [Arrival(0.0, pool[int(rng.integers(len(pool)))], int(rng.integers(low, high + 1))) for _ in range(IDLE_REQUESTS)]

    async def go() -> list[OnlineResult]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)) as client:
            t0 = time.monotonic()
            return [await online_request(client, base, arrival, t0) for arrival in arrivals]
    return idle_of(asyncio.run(go()))


def reset_server(base: str) -> str:
    """Wait until no request runs or waits (bounded), then empty the prefix cache: the next side starts as the first did."""
    started = time.monotonic()
    values = scrape_sync(base)
    while values.running + values.waiting > 0:
        if time.monotonic() - started > IDLE_TIMEOUT_S:
            return f"server still busy after {IDLE_TIMEOUT_S:.0f} s"
        time.sleep(1)
        values = scrape_sync(base)
    response = httpx.post(f"{base}/reset_prefix_cache", timeout=30)
    return "" if response.status_code == 200 else f"prefix cache not reset ({response.status_code})"


# ---------------------------------------------------------------- metrics

def snapshot_of(text: str) -> MetricsSnapshot:
    """The server's /metrics as batchllm's guard reads them (its parser: one reading of the names)."""
    snapshot = parse_metrics(text, time.monotonic())
    if snapshot is None or snapshot.generation_tokens is None or snapshot.preemptions is None:
        raise RuntimeError("the server's /metrics show no vLLM running, generated-token and preemption counts")
    return snapshot


def scrape_sync(base: str) -> MetricsSnapshot:
    return snapshot_of(httpx.get(f"{base}/metrics", timeout=10).text)


async def scrape(client: httpx.AsyncClient, base: str) -> MetricsSnapshot:
    return snapshot_of((await client.get(f"{base}/metrics")).text)


# ---------------------------------------------------------------- online load

def chat_body(prompt: str, max_tokens: int, priority: int, stream: bool = False, ignore_eos: bool = False) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.0,
            "priority": priority}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's sampling parameter: answer up to max_tokens
    if stream:
        body.update(stream=True, return_token_ids=True)  # token ids per chunk: how many tokens each chunk carries
    return body


async def online_request(client: httpx.AsyncClient, base: str, arrival: Arrival, t0: float) -> OnlineResult:
    result = OnlineResult(time.monotonic() - t0)
    body = chat_body(arrival.prompt, arrival.max_tokens, ONLINE_PRIORITY, stream=True, ignore_eos=arrival.ignore_eos)
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    tokens = sum(len(choice.get("token_ids") or []) for choice in json.loads(line[6:]).get("choices") or [])
                    if tokens:
                        result.chunks.append((time.monotonic() - t0, tokens))
    except (httpx.HTTPError, TimeoutError) as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def closed_loop_client(client: httpx.AsyncClient, base: str, load: ClosedLoop, number: int, t0: float) -> list[OnlineResult]:
    """One client of a population: joins at its turn, then sends its next request as soon as its last one ended."""
    rng = np.random.default_rng((load.seed, number))
    await asyncio.sleep(max(0.0, t0 + load.join_s * number / load.clients - time.monotonic()))
    results = []
    while time.monotonic() - t0 < load.end_s:
        arrival = Arrival(time.monotonic() - t0, load.pool[int(rng.integers(len(load.pool)))],
                          int(rng.integers(load.max_tokens[0], load.max_tokens[1] + 1)))
        results.append(await online_request(client, base, arrival, t0))
    return results


async def run_online(base: str, phases: list[Phase], online: OnlineLoad, at_end=None) -> tuple:
    """Send the arrivals on time (or run the population), scrape /metrics every SCRAPE_EVERY_S and at each phase bound; call at_end() at the
    last bound (the batch side stops there), then wait for the online requests still going."""
    end_s = phases[-1].end_s
    bound_times = [phases[0].start_s] + [p.end_s for p in phases]
    scrape_times = sorted(set(bound_times) | set(np.arange(0.0, end_s, SCRAPE_EVERY_S).round(3).tolist()))
    scrapes: list[tuple[float, MetricsSnapshot]] = []
    bounds: list[tuple[float, MetricsSnapshot]] = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)) as client, \
            httpx.AsyncClient(timeout=10.0) as metrics_client:
        t0 = time.monotonic()

        async def sampler() -> None:
            for at in scrape_times:
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                values = await scrape(metrics_client, base)
                scrapes.append((time.monotonic() - t0, values))
                if at in bound_times:
                    bounds.append(scrapes[-1])
                if at == end_s and at_end is not None:
                    at_end()

        async def lag_probe() -> None:
            while time.monotonic() - t0 < end_s:
                before = time.monotonic()
                await asyncio.sleep(LAG_PROBE_EVERY_S)
                lags.append((time.monotonic() - t0, time.monotonic() - before - LAG_PROBE_EVERY_S))

        lags: list[tuple[float, float]] = []
        sampling, probing = asyncio.create_task(sampler()), asyncio.create_task(lag_probe())
        if isinstance(online, ClosedLoop):
            clients = [asyncio.create_task(closed_loop_client(client, base, online, k, t0)) for k in range(online.clients)]
            await sampling
            await probing
            results = sorted((r for rs in await asyncio.gather(*clients) for r in rs), key=lambda r: r.sent_s)
            return results, scrapes, bounds, lags
        tasks = []
        for arrival in online:
            await asyncio.sleep(max(0.0, t0 + arrival.at_s - time.monotonic()))
            tasks.append(asyncio.create_task(online_request(client, base, arrival, t0)))
        await sampling
        await probing
        results = await asyncio.gather(*tasks)
    return list(results), scrapes, bounds, lags


# ---------------------------------------------------------------- batch sides

def fixed_client_command(base: str, batch_file: Path, concurrency: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "fixed-client", "--url", f"{base}/v1", "--input", str(batch_file),
            "--concurrency", str(concurrency)]


def write_dag(folder: Path, batch_file: Path, base: str, slo: LatencySlo, max_in_flight: int) -> Path:
    """The DAG batchllm runs: one node over the batch rows, its model served by the endpoint with the SLO."""
    dag = folder / "coserve.yaml"
    dag.write_text(
        "# written by benchmarks/coserve.py\n"
        "name: coserve\n"
        f"inputs:\n  rows: {{path: {batch_file}, id_column: id}}\n"
        "endpoints:\n"
        f"  {MODEL}:\n"
        f"    urls: [{base}/v1]\n"
        f"    slo: {{ttft_p99_s: {slo.ttft_p99_s:.4f}, itl_p99_s: {slo.itl_p99_s:.4f}}}\n"
        f"    max_in_flight: {max_in_flight}\n"
        f"nodes:\n  answer:\n    model: {MODEL}\n    prompt: '{{{{ prompt }}}}'\n"
        f"    sampling: {{max_tokens: {BATCH_MAX_TOKENS}, temperature: 0.0}}\n"
        "outputs:\n  answers: {columns: {answer: answer}}\n")
    return dag


def batchllm_command(executable: str, dag: Path, out: Path, extra: str) -> list[str]:
    return [executable, "run", str(dag), "--out", str(out), "--fresh", *shlex.split(extra)]


def wait_batch_started(base: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> float:
    """Until the server runs a batch request (nothing else is sent yet); fails if the batch process ends first."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the batch side exited ({proc.returncode}) before sending work:\n{tail(log)}")
        if scrape_sync(base).running > 0:
            return time.monotonic() - started
        time.sleep(0.5)
    raise RuntimeError(f"the batch side sent nothing in {timeout_s:.0f} s:\n{tail(log)}")


def run_side(name: str, base: str, phases: list[Phase], online_load: OnlineLoad, command: list[str] | None, workdir: Path,
             start_timeout_s: float = BATCH_START_TIMEOUT_S, settle_s: float = 2.0) -> SideRun:
    """One side from scratch: the batch process (if any) first, the phases once it runs, SIGINT at the last bound."""
    log = workdir / f"{name}.log"
    proc = None
    note = ""
    interrupted: list[bool] = []
    try:
        if command:
            with open(log, "w") as handle:
                proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, cwd=workdir)
            waited = wait_batch_started(base, proc, log, start_timeout_s)
            time.sleep(settle_s)
            note = f"batch running {waited:.1f} s after start"

        def at_end() -> None:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C at the end of the last phase
                interrupted.append(True)

        online, scrapes, bounds, lags = asyncio.run(run_online(base, phases, online_load, at_end))
    finally:
        code = stop_process(proc, None if interrupted else signal.SIGINT)
        busy = reset_server(base)
    if proc is not None:
        note += f"; exit {code}"
        if code not in (0, 130, -signal.SIGINT):
            note += f" (log {log})"
    return SideRun(name, phases, online, scrapes, bounds, lags, "; ".join(x for x in (note, busy) if x))


# ---------------------------------------------------------------- fixed client process

async def fixed_client(url: str, prompts: list[str], concurrency: int, priority: int, max_tokens: int) -> tuple[int, int]:
    """`concurrency` requests in flight over the prompts in order until they end or SIGINT; (requests done, tokens)."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    todo = iter(prompts)
    done = [0, 0]
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)) as client:
        async def worker() -> None:
            for prompt in todo:
                try:
                    response = await client.post(f"{url}/chat/completions", json=chat_body(prompt, max_tokens, priority))
                except httpx.HTTPError:
                    continue
                if response.status_code == 200:
                    done[0] += 1
                    done[1] += response.json()["usage"]["completion_tokens"]

        workers = asyncio.gather(*[worker() for _ in range(concurrency)], return_exceptions=True)
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([workers, stopping], return_when=asyncio.FIRST_COMPLETED)
        workers.cancel()  # closing the connections makes vLLM abort the requests
        await asyncio.gather(workers, return_exceptions=True)
        stopping.cancel()
    return done[0], done[1]


def fixed_client_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="coserve.py fixed-client")
    parser.add_argument("--url", required=True)
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--priority", type=int, default=BATCH_PRIORITY)
    parser.add_argument("--max-tokens", type=int, default=BATCH_MAX_TOKENS)
    args = parser.parse_args(argv)
    prompts = pq.read_table(args.input).column("prompt").to_pylist()
    requests, tokens = asyncio.run(fixed_client(args.url, prompts, args.concurrency, args.priority, args.max_tokens))
    print(f"fixed client: {args.concurrency} in flight, {requests} requests done, {tokens} output tokens", flush=True)


# ---------------------------------------------------------------- statistics

def ttfts(run: SideRun, lo: float, hi: float) -> np.ndarray:
    return np.array([r.ttft_s for r in run.online if r.ttft_s is not None and lo <= r.sent_s < hi])


def itls(run: SideRun, lo: float, hi: float) -> np.ndarray:
    return np.array(itl_samples(run.online, lo, hi))


def itl_samples(results: list[OnlineResult], lo: float, hi: float) -> list[float]:
    """Inter-token gaps of chunks received in [lo, hi), a chunk's gap split evenly over its tokens."""
    samples = []
    for r in results:
        for (before, _), (at, tokens) in zip(r.chunks, r.chunks[1:]):
            if lo <= at < hi:
                samples += [(at - before) / tokens] * tokens
    return samples


def online_running(run: SideRun, at: float) -> int:
    """Online requests decoding at time `at` (between their first and last token): the server's running gauge less
    these is the batch requests it runs."""
    return sum(1 for r in run.online if r.chunks and r.chunks[0][0] <= at <= r.chunks[-1][0])


def mean_batch_running(run: SideRun, scrapes: list[tuple[float, MetricsSnapshot]]) -> float:
    """The batch requests the server ran, on average over these scrapes (nan without any)."""
    gauges = [v.running - online_running(run, t) for t, v in scrapes]
    return float(np.mean(gauges)) if gauges else float("nan")


def online_tokens(run: SideRun, lo: float, hi: float) -> int:
    return sum(tokens for r in run.online for at, tokens in r.chunks if lo <= at < hi)


def counted(value: float | None) -> float:
    assert value is not None  # snapshot_of refuses a scrape without it
    return value


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def phase_stats(run: SideRun) -> list[dict]:
    """Per phase: online latencies and batch output tokens/s (server counter minus the online tokens, at the actual scrape times)."""
    stats = []
    for phase, (lo, begin), (hi, end) in zip(run.phases, run.bounds, run.bounds[1:]):
        generated = counted(end.generation_tokens) - counted(begin.generation_tokens)
        batch_tokens = generated - online_tokens(run, lo, hi)  # not clipped at 0: alone shows the method's error
        ttft, itl = ttfts(run, phase.start_s, phase.end_s), itls(run, phase.start_s, phase.end_s)
        stats.append({"phase": phase.name, "requests": sum(1 for r in run.online if phase.start_s <= r.sent_s < phase.end_s),
                      "errors": sum(1 for r in run.online if r.error and phase.start_s <= r.sent_s < phase.end_s),
                      "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
                      "batch_tps": batch_tokens / (hi - lo), "batch_tokens": batch_tokens, "seconds": hi - lo,
                      "batch_running": mean_batch_running(run, [(t, v) for t, v in run.scrapes if lo <= t <= hi]),
                      "preempted": counted(end.preemptions) - counted(begin.preemptions)})
    return stats


def window_stats(run: SideRun, window_s: float) -> list[dict]:
    """p99 TTFT (by send time) and ITL (by token time) per window after the first; a last window under half length is dropped."""
    end_s = run.phases[-1].end_s
    rows = []
    lo = window_s
    while lo + window_s / 2 <= end_s:
        hi = min(lo + window_s, end_s)
        inside = [(t, v) for t, v in run.scrapes if lo <= t < hi]
        server_itl = server_latency(inside[0][1], inside[-1][1]).itl_p99_s if len(inside) > 1 else None
        lags = np.array([lag for at, lag in run.loop_lags if lo <= at < hi])
        rows.append({"lo": lo, "hi": hi, "ttft_p99": pct(ttfts(run, lo, hi), 99), "itl_p99": pct(itls(run, lo, hi), 99),
                     "batch_running": mean_batch_running(run, inside),
                     "server_itl_p99": float("nan") if server_itl is None else server_itl, "loop_lag_p99": pct(lags, 99)})
        lo += window_s
    return rows


def kind_spans(phases: list[Phase], kind: str) -> list[tuple[float, float]]:
    return [(p.start_s, p.end_s) for p in phases if phase_kind(p.name) == kind]


def kind_latency(run: SideRun, kind: str, q: float) -> tuple[float, float]:
    """The q-th percentile of TTFT and ITL over the run's phases of this kind, pooled."""
    spans = kind_spans(run.phases, kind)
    return (pct(np.concatenate([ttfts(run, lo, hi) for lo, hi in spans]), q),
            pct(np.concatenate([itls(run, lo, hi) for lo, hi in spans]), q))


def reference_of(run: SideRun, kind: str) -> LatencySlo | None:
    """p99 TTFT and ITL over the run's phases of this kind, pooled (alone's: the reference); None without samples."""
    ttft, itl = kind_latency(run, kind, 99)
    return LatencySlo(ttft, itl) if ttft > 0 and itl > 0 else None


def heaviest(reference: LatencySlo, alone_windows: list[dict]) -> LatencySlo:
    """The heaviest alone latency: the reference phases' p99, or a judged window's where one was heavier. The reference
    phase is the heaviest load, but a p99 over a window's few requests can be heavier by chance (an AVX2-only host's (a):
    alone's light2 window read 1.50x its heavy phase's inter-token p99), and a bound alone itself breaks judges noise."""
    return LatencySlo(max([reference.ttft_p99_s, *(w["ttft_p99"] for w in alone_windows if w["ttft_p99"] == w["ttft_p99"])]),
                      max([reference.itl_p99_s, *(w["itl_p99"] for w in alone_windows if w["itl_p99"] == w["itl_p99"])]))


def batch_rate(run: SideRun) -> float:
    stats = phase_stats(run)
    return sum(s["batch_tokens"] for s in stats) / sum(s["seconds"] for s in stats)


def keeps(ttft_p99: float, itl_p99: float, slo: LatencySlo) -> bool:
    """Within the SLO; no samples (nan) break nothing."""
    return not (ttft_p99 > slo.ttft_p99_s or itl_p99 > slo.itl_p99_s)


def worst(values: list[float]) -> float:
    """The largest of values that are numbers (nan: a window without samples)."""
    numbers = [v for v in values if v == v]
    return max(numbers) if numbers else float("nan")


# ---------------------------------------------------------------- report

class Report:
    """Lines printed as they come and, with --out, written to a file at the end."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        self.lines.append(line)
        print(line, flush=True)

    def write(self, path: Path | None) -> None:
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(self.lines) + "\n")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.0f}" if seconds == seconds else "    n/a"


def report_side(say: Report, run: SideRun) -> None:
    for s in phase_stats(run):
        say(f"{run.name:<10} {s['phase']:<7} {s['requests']:>4} {s['errors']:>3}  {ms(s['ttft_p50'])} {ms(s['ttft_p99'])}  "
            f"{ms(s['itl_p50'])} {ms(s['itl_p99'])}  {s['batch_tps']:9.1f} {s['batch_running']:8.1f} {s['preempted']:6.0f}")
    if run.note:
        say(f"{'':<10} ({run.note})")


def side_header(say: Report) -> None:
    say(f"{'side':<10} {'phase':<7} {'reqs':>4} {'err':>3}  {'TTFT ms':>7} {'':>7}  {'ITL ms':>7} {'':>7}  {'batch':>9} "
        f"{'batch':>8} {'preem':>6}")
    say(f"{'':<10} {'':<7} {'':>4} {'':>3}  {'p50':>7} {'p99':>7}  {'p50':>7} {'p99':>7}  {'tok/s':>9} {'running':>8} {'':>6}")


@dataclass(frozen=True)
class Judge:
    """What a window is judged against: alone's heaviest p99s (the reference ratios are over) and the SLO, `margin` x them."""

    reference: LatencySlo
    margin: float = BASELINE_MARGIN

    @property
    def slo(self) -> LatencySlo:
        return scaled(self.reference, self.margin)

    def kept(self, window: dict) -> bool:
        """Whether a window's online p99s keep the SLO."""
        return keeps(window["ttft_p99"], window["itl_p99"], self.slo)


def worst_window(rows: list[dict], judge: Judge) -> tuple[float, float, int, int]:
    """Over a side's windows (window_stats): (worst TTFT p99 / reference, worst ITL p99 / reference,
    windows that kept the SLO, windows)."""
    ttft = worst([w["ttft_p99"] for w in rows]) / judge.reference.ttft_p99_s
    itl = worst([w["itl_p99"] for w in rows]) / judge.reference.itl_p99_s
    return ttft, itl, sum(1 for w in rows if judge.kept(w)), len(rows)


def scaled(slo: LatencySlo, factor: float) -> LatencySlo:
    return LatencySlo(slo.ttft_p99_s * factor, slo.itl_p99_s * factor)


def times(value: float | None) -> str:
    """A ratio as `1.23x`; n/a for a side not run."""
    return "n/a" if value is None or value != value else f"{value:.2f}x"


# ---------------------------------------------------------------- the matrix's lines

def number(value: float | None) -> float | None:
    """A ratio that is a number; None for one not measured (None or nan)."""
    return value if value is not None and value == value else None


def median_or_none(values: list[float | None]) -> float | None:
    numbers = [v for v in map(number, values) if v is not None]
    return median(numbers) if numbers else None


def worst_or_none(values: list[float | None]) -> float | None:
    numbers = [v for v in map(number, values) if v is not None]
    return max(numbers) if numbers else None


def oracle_median(results: list[ScenarioResult]) -> float | None:
    """batchllm's batch over the best safe fixed concurrency's, the median over the scenarios with a sweep (a, e)."""
    return median_or_none([r.gain for r in results if r.scenario.oracle])


def final_line(results: list[ScenarioResult]) -> str:
    return (f"worst scenario: online p99 TTFT {times(worst_or_none([r.ttft for r in results]))}, inter-token "
            f"{times(worst_or_none([r.itl for r in results]))} of alone; batch {times(oracle_median(results))} the best safe "
            "fixed concurrency (median over (a), (e))")


def targets_line(results: list[ScenarioResult], margin: float = BASELINE_MARGIN) -> str:
    over = [f"{r.scenario.label} {what} {times(value)}" for r in results
            for what, value in (("TTFT", r.ttft), ("inter-token", r.itl)) if number(value) is not None and value > margin]
    missing = [r.scenario.label for r in results if number(r.ttft) is None or number(r.itl) is None]
    latency = f"no ({', '.join(over)})" if over else "n/a" if len(missing) == len(results) else "yes"
    if missing and len(missing) < len(results):
        latency += f"; not measured: {', '.join(missing)}"
    gain = oracle_median(results)
    batch = "n/a" if gain is None else "yes" if gain >= ORACLE_TARGET else "no"
    return (f"targets: online p99 TTFT and inter-token <= {margin:g}x alone in every scenario's worst window: {latency}; "
            f"batch >= {ORACLE_TARGET}x the best safe fixed concurrency (median over (a), (e)): {batch}")


def matrix_summary(args: argparse.Namespace, say: Report, results: list[ScenarioResult]) -> None:
    say()
    say(f"matrix: batchllm's worst {args.window_s:.0f} s window per scenario (p99 over alone's heaviest p99; SLO "
        f"{args.slo_margin:g}x), its batch tokens/s over all phases and, in (a) and (e), over the best safe fixed concurrency's:")
    say(f"{'scenario':<22} {'TTFT':>6} {'ITL':>6} {'windows kept':>13} {'batch tok/s':>12} {'vs oracle':>10} {'runtime':>8}")
    for r in results:
        kept = f"{r.kept}/{r.windows}" if r.windows else "n/a"
        tps = "n/a" if r.batch_tps is None else f"{r.batch_tps:.1f}"
        gain = times(r.gain) if r.scenario.oracle else "-"
        say(f"{r.scenario.label:<22} {times(r.ttft):>6} {times(r.itl):>6} {kept:>13} {tps:>12} {gain:>10} {r.seconds:7.0f}s")
    say(targets_line(results, args.slo_margin))
    say(f"total runtime: {time.monotonic() - args.started:.0f} s")
    say(final_line(results))


# ---------------------------------------------------------------- the benchmark

def sweep_levels(quick: bool, max_num_seqs: int) -> list[int]:
    return [1, 2, 4] if quick else [c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256) if c <= max_num_seqs]


def scenario_seconds(args: argparse.Namespace, scenario: Scenario) -> tuple[float, float]:
    """Rough wall time of a scenario (every side's phases, start, stop and drain; the probes): with a sweep that stops at
    4 in flight, and with one that runs every level."""
    length = scenario_phases(scenario, 1.0, args.phase_s, args.window_s)[-1].end_s
    side = length + SIDE_OVERHEAD_S + (LONG_ANSWER_S if scenario.unit == LONG_ANSWER else 0.0)  # the last answers end later
    batchllm = "batchllm" in args.sides
    fixed = side * (1 + batchllm + ("again" in args.sides)) + BATCHLLM_START_S * batchllm
    if scenario.unit == SATURATING:
        fixed += LIKELY_PROBES * (args.probe_min_s + SIDE_OVERHEAD_S)
    if not scenario.oracle:
        return fixed, fixed
    fixed += side * ("fixed" in args.sides)
    levels = len(sweep_levels(args.quick, scenario.server.seqs)) if "oracle" in args.sides else 0
    return fixed + min(3, levels) * side, fixed + levels * side


def pick_scenarios(spec: str, catalogue: list[Scenario]) -> list[Scenario]:
    """The scenarios a comma list names (letters or names), in the matrix's order."""
    wanted = {word.strip() for word in spec.split(",") if word.strip()}
    unknown = wanted - {s.key for s in catalogue} - {s.name for s in catalogue}
    if unknown or not wanted:
        raise ValueError(f"unknown scenarios: {', '.join(sorted(unknown)) or '(none named)'}")
    return [s for s in catalogue if s.key in wanted or s.name in wanted]


def main() -> None:
    # The batch sides are stopped with SIGINT, as Ctrl-C; started in the background, this process ignores SIGINT
    # and its children would inherit that (a handler of its own is reset in them to the default, which stops them).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    catalogue = ", ".join(f"{s.key} {s.name}" for s in make_scenarios(Server("tuned")))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default="a,b,c,d,e", help=f"comma list of letters or names ({catalogue}; default all)")
    parser.add_argument("--phase-s", type=float, default=None,
                        help="each phase of (a) and (e) (default 60 for a single scenario, else one window; --quick: 15)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 15 s phases, 10 s windows, sweep 1, 2, 4, 10 s probes")
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    parser.add_argument("--sides", default="fixed,oracle,batchllm",
                        help="sides to run after alone (comma list: fixed, oracle, batchllm, again; fixed and oracle in (a) and (e) only; again: alone once more, the noise floor)")
    parser.add_argument("--window-s", type=float, default=None, help="SLO check window (default 30; --quick: 10)")
    parser.add_argument("--slo-margin", type=float, default=BASELINE_MARGIN,
                        help=f"the SLO as a multiple of alone's heaviest p99s, for batchllm's DAG and every window's verdict "
                             f"(default {BASELINE_MARGIN}: the issue's; larger: how the batch fares against a laxer SLO)")
    parser.add_argument("--light-load", type=float, default=LIGHT_LOAD,
                        help="light phases: online requests in flight if each took its idle time (rate x idle request time)")
    parser.add_argument("--heavy-load", type=float, default=HEAVY_LOAD, help="the heavy phase's, the same way")
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, help="the tuned server's")
    parser.add_argument("--max-num-batched-tokens", type=int, default=CHUNK_TOKENS,
                        help="the tuned server's token budget per step, its prefill chunk (vLLM's own default on CPUs: 2048)")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batchllm", default=str(Path(sys.executable).parent / "batchllm"), help="the batchllm executable")
    parser.add_argument("--batchllm-args", default="", help="extra arguments for `batchllm run` (one string)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, DAGs, batchllm's --out)")
    args = parser.parse_args()
    tuned = Server("tuned", args.max_num_seqs, args.max_num_batched_tokens)
    try:
        scenarios = pick_scenarios(args.scenarios, make_scenarios(tuned, args.light_load, args.heavy_load))
    except ValueError as error:
        parser.error(str(error))
    args.window_s = args.window_s or (10.0 if args.quick else 30.0)
    args.phase_s = args.phase_s or (15.0 if args.quick else 60.0 if len(scenarios) == 1 else args.window_s)
    args.probe_min_s = PROBE_MIN_S / 2 if args.quick else PROBE_MIN_S
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = set(args.sides) - {"fixed", "oracle", "batchllm", "again"}
    if unknown:
        parser.error(f"unknown sides: {', '.join(sorted(unknown))}")
    if not args.slo_margin >= 1.0:
        parser.error(f"--slo-margin must be at least 1 (alone keeps its own p99), got {args.slo_margin:g}")
    if any(s.shape == THREE_PHASES for s in scenarios) and 3 * args.phase_s < 2 * args.window_s:
        parser.error(f"the phases ({3 * args.phase_s:g} s) hold no window after the first ({args.window_s:g} s): "
                     "lengthen --phase-s or shorten --window-s")

    args.started = time.monotonic()
    args.cpus = os.sched_getaffinity(0)  # each server starts from these (this process moves to the client core)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: the finally blocks stop the server
    say = Report()
    workdir = Path(tempfile.mkdtemp(prefix="coserve-"))
    if args.keep:
        print(f"work folder (kept): {workdir}")
    try:
        benchmark(args, scenarios, say, workdir)
    except BaseException:
        say(f"total runtime: {time.monotonic() - args.started:.0f} s (stopped by an error)")
        raise
    finally:
        say.write(args.out)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def benchmark(args: argparse.Namespace, scenarios: list[Scenario], say: Report, workdir: Path) -> None:
    """Everything after the arguments: per server its scenarios, then the matrix."""
    from batchllm.models.embedded import SMOLLM2_135M
    from batchllm.models.registry import batchllm_home

    online_pool, batch_prompts = load_prompts(args.seed)
    longest = max(scenario_phases(s, 1.0, args.phase_s, args.window_s)[-1].end_s for s in scenarios)
    batch_file = write_batch_input(workdir, batch_prompts, int(longest * 5))
    plans = [scenario_seconds(args, s) for s in scenarios]
    servers = by_server(scenarios)
    likely = SERVER_SETUP_S * len(servers) + sum(p[0] for p in plans)
    most = SERVER_SETUP_S * len(servers) + sum(p[1] for p in plans)
    say(f"coserve: {MODEL} served by vLLM on core {args.server_core} (priority scheduling, KV {KV_CACHE_BYTES / 1e9:.0f} GB), "
        f"clients on core {args.client_core}; {pq.read_metadata(batch_file).num_rows} batch rows (max_tokens {BATCH_MAX_TOKENS}, "
        f"priority {BATCH_PRIORITY}); windows {args.window_s:.0f} s; sides alone, {', '.join(args.sides)}; scenarios "
        + ", ".join(f"{s.label} ~{p[0] / 60:.0f} min" for s, p in zip(scenarios, plans))
        + f"; planned about {likely / 60:.0f} min"
        + (f" (if each sweep stops by 4 in flight; at most {most / 60:.0f} min)" if most > likely else ""))

    model_dir = SMOLLM2_135M.prepare(batchllm_home())
    results = []
    for server, group in servers:
        with serving(args, server, model_dir, workdir, say, online_pool, batch_prompts) as (base, idle):
            for scenario in group:
                results.append(run_scenario(args, scenario, say, workdir, base, idle, online_pool, batch_file))
    matrix_summary(args, say, results)


@contextmanager
def serving(args: argparse.Namespace, server: Server, model_dir: Path, workdir: Path, say: Report, online_pool: list[str],
            batch_prompts: list[str]) -> Iterator[tuple[str, Idle]]:
    """The server started (from every core this process had: a server started later would inherit the client core),
    warmed up and its idle latency measured; always stopped."""
    base = f"http://127.0.0.1:{args.port}"
    log = workdir / f"server-{server.name}.log"
    os.sched_setaffinity(0, args.cpus)
    proc = start_server(model_dir, args.port, args.server_core, server.max_num_seqs, log, server.max_num_batched_tokens)
    try:
        say()
        say(f"{server.describe()} healthy after {wait_healthy(base, proc, log):.0f} s")
        os.sched_setaffinity(0, {args.client_core})  # this process and every batch process it starts from here on
        warm_up(base, online_pool, batch_prompts)
        idle = measure_idle(base, online_pool, args.seed)
        say(f"idle: {IDLE_REQUESTS} lone online requests one after another: TTFT p50 {idle.ttft_s * 1000:.0f} ms, inter-token "
            f"p50 {idle.itl_s * 1000:.1f} ms, request p50 {idle.request_s:.2f} s")
        note = reset_server(base)
        if note:
            say(f"warning: {note}")
        yield base, idle
    except BaseException:
        if proc.poll() is not None:
            say(f"server log:\n{tail(log)}")
        raise
    finally:
        stop_process(proc, signal.SIGTERM)


def run_scenario(args: argparse.Namespace, scenario: Scenario, say: Report, workdir: Path, base: str, idle: Idle,
                 online_pool: list[str], batch_file: Path) -> ScenarioResult:
    """A scenario from its sizing to its summary, its sides' logs and DAG in a folder of its own."""
    started = time.monotonic()
    folder = workdir / f"{scenario.key}-{scenario.name}"
    folder.mkdir()
    say()
    say(f"== {scenario.label} on the {scenario.server.describe()}")
    load = size_load(args, scenario, idle, say, base, online_pool, folder)
    phases = scenario_phases(scenario, load.unit_rate, args.phase_s, args.window_s)
    online = load.online(phases, online_pool, args.seed)
    sides = ["alone"] + [s for s in args.sides if scenario.oracle or s in ("batchllm", "again")]
    if isinstance(online, ClosedLoop):
        sent = (f"{online.clients} clients joining over {phases[0].name}, each sending its next request when its last "
                f"ended, until {online.end_s:g} s")
        shape = ", ".join(f"{p.name} {p.start_s:g}-{p.end_s:g} s" for p in phases)
    else:
        sent = f"{len(online)} online requests"
        shape = ", ".join(f"{p.name} {p.rate:.3g}/s {p.start_s:g}-{p.end_s:g} s" for p in phases)
    say(f"{scenario.label}: loads {', '.join(f'{x:g}' for x in scenario.loads)} x {scenario.unit} ({load.how}); phases {shape}; "
        + f"{sent} (max_tokens {load.max_tokens[0]}-{load.max_tokens[1]}"
        + (", answered to max_tokens" if load.ignore_eos else "") + f"); sides {', '.join(sides)}")
    return run_sides(args, scenario, say, folder, base, phases, online, batch_file, idle, started)


def size_load(args: argparse.Namespace, scenario: Scenario, idle: Idle, say: Report, base: str, online_pool: list[str],
              folder: Path) -> Load:
    """The scenario's unit rate (and answer lengths) from the server's idle latency, or from probes (saturated)."""
    if scenario.unit == LONG_ANSWER:
        tokens = long_answer_tokens(idle.itl_s)
        seconds = long_answer_s(idle, tokens)
        return Load(1.0 / seconds, (tokens, tokens), True,
                    f"{seconds:.1f} s: max_tokens {tokens} = ceil({LONG_ANSWER_S:g} s / idle inter-token p50), within "
                    f"{LONG_ANSWER_TOKENS[0]}-{LONG_ANSWER_TOKENS[1]}")
    if scenario.unit == SATURATING:
        clients, how = probe_saturation(args, idle, say, base, online_pool, folder)
        return Load(0.0, ONLINE_MAX_TOKENS, False, how, clients)
    return Load(1.0 / idle.request_s, ONLINE_MAX_TOKENS, False, f"{idle.request_s:.2f} s")


def probe_saturation(args: argparse.Namespace, idle: Idle, say: Report, base: str, online_pool: list[str],
                     folder: Path) -> tuple[int, str]:
    """Probes of online load alone (saturating_rate over populations): the clients at which the inter-token p50
    reaches SATURATION_FACTOR x idle, and how they were found."""
    probe_s = max(args.probe_min_s, PROBE_REQUESTS * idle.request_s)
    seen: dict[int, float] = {}

    def itl_at(population: float) -> float:
        clients = round(population)
        if clients not in seen:
            phases = [Phase("probe", 0.0, 0.0, probe_s)]
            load = ClosedLoop(clients, probe_s / 4, probe_s, tuple(online_pool), args.seed)
            run = run_side(f"probe{len(seen) + 1}", base, phases, load, None, folder)
            seen[clients] = pct(itls(run, probe_s / 2, probe_s), 50)
            say(f"{'':<10} probe {clients} clients: inter-token p50 {seen[clients] * 1000:.0f} ms = "
                f"{seen[clients] / idle.itl_s:.1f}x idle (its second half)")
        return seen[clients]

    say(f"{'':<10} saturating population: probes of {probe_s:.0f} s (clients joining over its first quarter) from "
        f"{SATURATION_START_CLIENTS} clients, x{SATURATION_STEP:g} until the inter-token p50 is >= {SATURATION_FACTOR:g}x idle "
        f"({SATURATION_FACTOR * idle.itl_s * 1000:.0f} ms), then {SATURATION_SPLITS} halvings of the last step")
    population, reached = saturating_rate(itl_at, SATURATION_START_CLIENTS, SATURATION_FACTOR * idle.itl_s,
                                          step=SATURATION_STEP, probes=SATURATION_PROBES)
    clients = round(population)
    how = (f"{clients} clients; inter-token p50 {seen[clients] / idle.itl_s:.1f}x idle in its probe"
           + ("" if reached else f"; no probe reached {SATURATION_FACTOR:g}x: the largest probed"))
    say(f"{'':<10} chose {how}")
    return clients, how


def run_sides(args: argparse.Namespace, scenario: Scenario, say: Report, folder: Path, base: str, phases: list[Phase],
              arrivals: OnlineLoad, batch_file: Path, idle: Idle, started: float) -> ScenarioResult:
    """alone, then (a, e) the fixed client and the sweep, then batchllm; the scenario's summary."""
    runs: dict[str, SideRun] = {}
    side_header(say)
    runs["alone"] = alone = run_side("alone", base, phases, arrivals, None, folder)
    report_side(say, alone)
    phase_reference = reference_of(alone, scenario.reference)
    if phase_reference is None:
        say(f"{'':<10} no online latency in alone's {scenario.reference} phases: no reference, no batch side")
        return ScenarioResult(scenario, seconds=time.monotonic() - started)
    judge = Judge(heaviest(phase_reference, window_stats(alone, args.window_s)), args.slo_margin)
    slo = judge.slo
    say(f"{'':<10} SLO = {judge.margin:g}x the heavier of alone's {scenario.reference}-phase p99 (TTFT "
        f"{phase_reference.ttft_p99_s * 1000:.0f} ms, inter-token {phase_reference.itl_p99_s * 1000:.1f} ms) and its worst window's: "
        f"TTFT {slo.ttft_p99_s * 1000:.0f} ms, inter-token {slo.itl_p99_s * 1000:.1f} ms (alone's inter-token p50 in the "
        f"{scenario.reference} phases: {kind_latency(alone, scenario.reference, 50)[1] / idle.itl_s:.1f}x idle)")

    seqs = scenario.server.seqs
    if scenario.oracle and "fixed" in args.sides:
        runs["fixed"] = run_side(f"fixed{seqs}", base, phases, arrivals, fixed_client_command(base, batch_file, seqs), folder)
        report_side(say, runs["fixed"])
    if scenario.oracle and "oracle" in args.sides:
        oracle = sweep_fixed(args, sweep_levels(args.quick, seqs), phases, arrivals, say, folder, base, batch_file, judge)
        if oracle is not None:
            runs["oracle"] = oracle
    if "batchllm" in args.sides:
        dag = write_dag(folder, batch_file, base, slo, seqs)
        command = batchllm_command(args.batchllm, dag, folder / "batchllm-out", args.batchllm_args)
        say(f"{'':<10} batchllm: {shlex.join(command)}")
        try:
            runs["batchllm"] = run_side("batchllm", base, phases, arrivals, command, folder)
            report_side(say, runs["batchllm"])
        except RuntimeError as error:
            say(f"batchllm side failed: {error}")
    if "again" in args.sides:
        runs["again"] = run_side("alone2", base, phases, arrivals, None, folder)
        report_side(say, runs["again"])
    return summary(args, scenario, say, runs, judge, started)


def sweep_fixed(args, sweep: list[int], phases: list[Phase], arrivals: OnlineLoad, say: Report, workdir: Path,
                base: str, batch_file: Path, judge: Judge) -> SideRun | None:
    """The run of the largest fixed concurrency that keeps the SLO in every window after the first (the windows batchllm
    is judged on, the issue's "best fixed concurrency that kept every window"), up to the first that breaks one; None when
    even 1 in flight breaks one. Until 2026-12-07 only the heavy phase's windows were judged here: in 2 of the 13 matrices
    of 2026-11-29 and -30 on hosts as fast as that day's, the level so picked broke a light window that batchllm was held
    to ((a) at 4, 1.33x first-token; (e) at 4, 1.79x first-token: benchmarks/results/coserve-sweeps-2026-12-07.txt).
    A p99 over a short heavy-only run is kinder still: the concurrency it picks often broke a window of the full run
    (benchmarks/results/coserve-guard-band-2026-11-26.txt)."""
    best, kept_run = 0, None
    for concurrency in sweep:
        run = run_side(f"sweep{concurrency}", base, phases, arrivals, fixed_client_command(base, batch_file, concurrency), workdir)
        report_side(say, run)
        windows = window_stats(run, args.window_s)
        kept = sum(1 for w in windows if judge.kept(w))
        say(f"{'':<10} per window " + " ".join(window_cell(w, judge) for w in windows) + f"; {kept}/{len(windows)} kept, "
            + ("keeps the SLO" if kept == len(windows) else "breaks the SLO"))
        if kept < len(windows):
            break
        best, kept_run = concurrency, replace(run, name=f"oracle{concurrency}")
    say(f"{'':<10} best safe fixed concurrency: {best or 'none (even 1 in flight breaks the SLO)'}")
    return kept_run


def window_cell(window: dict, judge: Judge) -> str:
    """`1.02/0.97*`: a window's p99 TTFT and ITL over the reference, * when it breaks the SLO."""
    return (f"{window['ttft_p99'] / judge.reference.ttft_p99_s:.2f}/{window['itl_p99'] / judge.reference.itl_p99_s:.2f}"
            f"{'' if judge.kept(window) else '*'}")


def summary(args, scenario: Scenario, say: Report, runs: dict[str, SideRun], judge: Judge,
            started: float) -> ScenarioResult:
    """A scenario's sides against its reference; what the matrix reports of it."""
    over = "alone's heaviest p99"
    say()
    say(f"SLO per {args.window_s:.0f} s window after the first (p99, worst window over {over}; SLO {judge.margin:g}x):")
    say(f"{'side':<10} {'TTFT':>6} {'ITL':>6} {'windows kept':>13} {'batch tok/s (all phases)':>25}")
    windows = {name: window_stats(run, args.window_s) for name, run in runs.items()}
    worsts = {}
    for name, run in runs.items():
        worsts[name] = worst_window(windows[name], judge)
        ttft, itl, kept, total = worsts[name]
        say(f"{run.name:<10} {ttft:5.2f}x {itl:5.2f}x {kept:>6}/{total:<6} {batch_rate(run):25.1f}")
    say()
    say(f"per window (p99 over {over}, TTFT/ITL; * breaks the SLO; then the batch requests the server ran):")
    for name, run in runs.items():
        cells = [window_cell(w, judge) for w in windows[name]]
        running = [f"{w['batch_running']:.1f}" for w in windows[name]]
        say(f"{run.name:<10} " + " ".join(f"{c:>11}" for c in cells) + "   " + " ".join(f"{r:>5}" for r in running))
    say("per window, what the client's inter-token p99 above rests on: the server's own (all requests, from its histogram, ms) / "
        "how late this process's event loop woke (p99, ms):")
    for name, run in runs.items():
        cells = [f"{1000 * w['server_itl_p99']:.0f}/{1000 * w['loop_lag_p99']:.0f}" for w in windows[name]]
        say(f"{run.name:<10} " + " ".join(f"{c:>11}" for c in cells))
    gain = None  # n/a without an oracle run: even 1 in flight broke a window, nothing to compare with
    if "batchllm" in runs and "oracle" in runs:
        gain = batch_rate(runs["batchllm"]) / max(batch_rate(runs["oracle"]), 1e-9)
    if "batchllm" in runs:
        ttft, itl, kept, total = worsts["batchllm"]
        versus = "n/a" if gain is None else "yes" if gain >= 1.0 else "no"
        say(f"targets: batchllm keeps the SLO in every window: {'yes' if kept == total else 'no'} ({kept}/{total})"
            + (f"; batch >= 1.0x the oracle's: {versus}" if scenario.oracle else ""))
    seconds = time.monotonic() - started
    say(f"{scenario.label} runtime: {seconds:.0f} s")
    b_ttft, b_itl = worsts["batchllm"][:2] if "batchllm" in worsts else (None, None)
    line = f"{scenario.label}: online p99 TTFT {times(b_ttft)}, inter-token {times(b_itl)} of alone (worst window)"
    if scenario.oracle:
        f_ttft, f_itl = worsts["fixed"][:2] if "fixed" in worsts else (None, None)
        line += (f"; batch {times(gain)} the best safe fixed concurrency; fixed client p99 TTFT {times(f_ttft)}, inter-token "
                 f"{times(f_itl)}")
    say(line)
    if "batchllm" not in runs:
        return ScenarioResult(scenario, seconds=seconds)
    kept, total = worsts["batchllm"][2:]
    return ScenarioResult(scenario, b_ttft, b_itl, kept, total, batch_rate(runs["batchllm"]), gain, seconds)


if __name__ == "__main__":
    if sys.argv[1:2] == ["fixed-client"]:
        fixed_client_main(sys.argv[2:])
    else:
        main()
