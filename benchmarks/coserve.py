"""A batch beside an online service on one shared vLLM server: does the online traffic keep
its latency, and how much batch work gets done?

    .venv/bin/python benchmarks/coserve.py [--phase-s 60] [--quick] [--port 8431] [--out FILE]

One real vLLM OpenAI server (`python -m vllm.entrypoints.openai.api_server`, priority
scheduling, `--max-num-seqs` 128 = vLLM's CPU default) serves the embedded model
(smollm2-135m) on ONE core (`--server-core`, default 0). This process, the batch clients
and batchllm run on the other core (`--client-core`, default 1). Everything talks over
127.0.0.1.

Online load (this process, async httpx): streamed chat completions at priority 0, Poisson
arrivals of real chat prompts (ShareGPT first turns of at most 1,000 characters, from
profiles/prompts/first_turns.parquet), max_tokens 32-64, greedy. Three phases of
`--phase-s` each: light (`--light-rate`, 1 request/s), heavy (`--heavy-rate`, 3/s), light
again. The arrival times and prompts come from `--seed` and are the same for every side.
Each request measures its own time to first token (TTFT: send to the first chunk carrying
tokens) and inter-token latency (ITL: the gap before each later chunk, split evenly over
the tokens it carries; `return_token_ids` gives the count, logprobs would slow the server).

Batch work: other ShareGPT first turns of 20-1,000 characters (none of the online ones), shuffled, one
Parquet file for every batch side, max_tokens 128, greedy, priority 1 (vLLM runs lower
values first: batch after online). The sides, one after another on the same server, each
started from scratch beside the same online load (prefix cache reset and server idle
between sides):

    alone      no batch: the reference. SLO = 1.25 x its p99 TTFT and ITL over the heavy
               phase (the heaviest alone latency, one bound for every phase and window)
    fixed      a plain HTTP batch client (non-streamed) at the server's max_num_seqs
    sweep      the fixed client at 1, 2, 4, 8 ... in flight over all phases until one breaks the
               SLO in a window of the heavy phase (30 s windows, the rule batchllm is held to);
               the largest that kept them is
    oracle     the best safe fixed concurrency, a number no user has (its sweep run)
    batchllm   `batchllm run DAG --out DIR` whose DAG names the server under `endpoints:`
               with the SLO; SIGINT at the end of the last phase

A batch side starts first; the phases begin once the server runs its requests. Batch output
tokens/s per phase is measured the same way for every side: the server's
`vllm:generation_tokens_total` (/metrics, scraped at the phase bounds) over the phase,
minus the online generator's own tokens received in it.

Printed: per side and phase the online requests (and errors), p50/p99 TTFT and ITL, batch
tokens/s, the mean number of batch requests the server ran (its running gauge less the
online requests between their first and last token) and preemptions; per side the worst
`--window-s` (30 s) window after the first against the SLO; the sweep; the total runtime.
The alone side's batch tokens/s (not clipped at 0) is the error of the method (0.0 in the
smoke runs). Targets: batchllm keeps the SLO in every window after the first, and its batch
tokens/s over the three phases is >= 1.2x the oracle's. Ratios in the last line are
worst-window p99 over alone's heavy-phase p99 (the SLO is 1.25x).

`--sides` picks the batch sides (alone always runs); `--quick` is a smoke run (15 s phases,
10 s windows, sweep 1, 2, 4). A default run takes about 22 minutes if the sweep stops by 4
in flight (the plan is printed at the start, the runtime at the end); `--out` also writes
the report to a file, otherwise only stdout. `--keep` keeps the work folder (server and
batch logs, the DAG, batchllm's --out).

The server is set up as one that co-serves: prefill in chunks of CHUNK_TOKENS a step
(`--max-num-batched-tokens`). With vLLM's CPU default of 2048, one long batch prompt's
prefill stalls every online request decoding beside it for that step: in a quick run on a
loaded machine, one batch request in flight took the heavy-phase ITL p99 from 0.20 s
(alone) to 1.6 s, so no batch at all would keep the SLO.

Internal: `coserve.py fixed-client ...` is the fixed client's own process (started by the
benchmark, like batchllm: a separate process, SIGINT to stop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

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


def make_arrivals(phases: list[Phase], pool: list[str], seed: int) -> list[Arrival]:
    """Poisson arrivals per phase; the same seed gives the same requests at the same times."""
    rng = np.random.default_rng(seed)
    arrivals = []
    for phase in phases:
        at = phase.start_s
        while (at := at + rng.exponential(1.0 / phase.rate)) < phase.end_s:
            arrivals.append(Arrival(at, pool[int(rng.integers(len(pool)))], int(rng.integers(ONLINE_MAX_TOKENS[0],
                                                                                                 ONLINE_MAX_TOKENS[1] + 1))))
    return arrivals


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


def start_server(model_dir: Path, port: int, core: int, max_num_seqs: int, log: Path,
                 max_num_batched_tokens: int | None = None) -> subprocess.Popen:
    from batchllm.engines.devices import engine_dtype

    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1",
           "VLLM_SERVER_DEV_MODE": "1"}  # dev mode: POST /reset_prefix_cache between sides
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name", MODEL,
               "--enforce-eager", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--scheduling-policy", "priority",
               "--max-num-seqs", str(max_num_seqs), "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
               "--disable-uvicorn-access-log"]
    if max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
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

def chat_body(prompt: str, max_tokens: int, priority: int, stream: bool = False) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.0,
            "priority": priority}
    if stream:
        body.update(stream=True, return_token_ids=True)  # token ids per chunk: how many tokens each chunk carries
    return body


async def online_request(client: httpx.AsyncClient, base: str, arrival: Arrival, t0: float) -> OnlineResult:
    result = OnlineResult(time.monotonic() - t0)
    body = chat_body(arrival.prompt, arrival.max_tokens, ONLINE_PRIORITY, stream=True)
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


async def run_online(base: str, phases: list[Phase], arrivals: list[Arrival], at_end=None) -> tuple:
    """Send the arrivals on time, scrape /metrics every SCRAPE_EVERY_S and at each phase bound; call at_end() at the
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
        tasks = []
        for arrival in arrivals:
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


def run_side(name: str, base: str, phases: list[Phase], arrivals: list[Arrival], command: list[str] | None, workdir: Path,
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

        online, scrapes, bounds, lags = asyncio.run(run_online(base, phases, arrivals, at_end))
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
    samples = []
    for r in run.online:
        for (before, _), (at, tokens) in zip(r.chunks, r.chunks[1:]):
            if lo <= at < hi:
                samples += [(at - before) / tokens] * tokens
    return np.array(samples)


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


def kept_window(window: dict, reference: LatencySlo) -> bool:
    """Whether a window's online p99s keep the SLO, BASELINE_MARGIN x the reference."""
    return keeps(window["ttft_p99"], window["itl_p99"], scaled(reference, BASELINE_MARGIN))


def worst_window(rows: list[dict], reference: LatencySlo) -> tuple[float, float, int, int]:
    """Over a side's windows (window_stats): (worst TTFT p99 / reference, worst ITL p99 / reference,
    windows kept within the margin, windows)."""
    ttft = worst([w["ttft_p99"] for w in rows]) / reference.ttft_p99_s
    itl = worst([w["itl_p99"] for w in rows]) / reference.itl_p99_s
    return ttft, itl, sum(1 for w in rows if kept_window(w, reference)), len(rows)


def scaled(slo: LatencySlo, factor: float) -> LatencySlo:
    return LatencySlo(slo.ttft_p99_s * factor, slo.itl_p99_s * factor)


def times(value: float | None) -> str:
    """A ratio as `1.23x`; n/a for a side not run."""
    return "n/a" if value is None or value != value else f"{value:.2f}x"


# ---------------------------------------------------------------- the benchmark

def planned_seconds(args: argparse.Namespace, sweep: list[int]) -> tuple[float, float]:
    """Rough wall time of a run (server start and warm-up, every side's phases, start, stop and drain): with a sweep
    that stops at 4 in flight, and with one that runs every level."""
    sides = 1 + sum(side in args.sides for side in ("fixed", "batchllm"))
    fixed = 60 + sides * (3 * args.phase_s + 20) + (30 if "batchllm" in args.sides else 0)
    level_s = (3 * args.phase_s + 20) if "oracle" in args.sides else 0
    return fixed + min(3, len(sweep)) * level_s, fixed + len(sweep) * level_s


def main() -> None:
    # The batch sides are stopped with SIGINT, as Ctrl-C; started in the background, this process ignores SIGINT
    # and its children would inherit that (a handler of its own is reset in them to the default, which stops them).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phase-s", type=float, default=None, help="length of each of the three phases (default 60; --quick: 15)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 15 s phases, 10 s windows, sweep 1, 2, 4")
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    parser.add_argument("--sides", default="fixed,oracle,batchllm", help="batch sides to run after alone (comma list)")
    parser.add_argument("--window-s", type=float, default=None, help="SLO check window (default 30; --quick: 10)")
    parser.add_argument("--light-rate", type=float, default=1.0)
    parser.add_argument("--heavy-rate", type=float, default=3.0)
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS)
    parser.add_argument("--max-num-batched-tokens", type=int, default=CHUNK_TOKENS,
                        help="the server's token budget per step, its prefill chunk (vLLM's own default on CPUs: 2048)")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batchllm", default=str(Path(sys.executable).parent / "batchllm"), help="the batchllm executable")
    parser.add_argument("--batchllm-args", default="", help="extra arguments for `batchllm run` (one string)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, DAG, batchllm's --out)")
    args = parser.parse_args()
    args.phase_s = args.phase_s or (15.0 if args.quick else 60.0)
    args.window_s = args.window_s or (10.0 if args.quick else 30.0)
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = set(args.sides) - {"fixed", "oracle", "batchllm"}
    if unknown:
        parser.error(f"unknown sides: {', '.join(sorted(unknown))}")
    if 3 * args.phase_s < 2 * args.window_s:
        parser.error(f"the phases ({3 * args.phase_s:g} s) hold no window after the first ({args.window_s:g} s): "
                     "lengthen --phase-s or shorten --window-s")
    sweep = [1, 2, 4] if args.quick else [c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256) if c <= args.max_num_seqs]

    args.started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: the finally blocks stop the server
    say = Report()
    workdir = Path(tempfile.mkdtemp(prefix="coserve-"))
    if args.keep:
        print(f"work folder (kept): {workdir}")
    try:
        benchmark(args, sweep, say, workdir)
    except BaseException:
        say(f"total runtime: {time.monotonic() - args.started:.0f} s (stopped by an error)")
        raise
    finally:
        say.write(args.out)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def benchmark(args: argparse.Namespace, sweep: list[int], say: Report, workdir: Path) -> None:
    """Everything after the arguments, the server started and always stopped here."""
    from batchllm.models.embedded import SMOLLM2_135M
    from batchllm.models.registry import batchllm_home

    base = f"http://127.0.0.1:{args.port}"
    online_pool, batch_prompts = load_prompts(args.seed)
    phases = make_phases(args.phase_s, args.light_rate, args.heavy_rate)
    arrivals = make_arrivals(phases, online_pool, args.seed)
    batch_file = write_batch_input(workdir, batch_prompts, int(3 * args.phase_s * 5))
    likely, most = planned_seconds(args, sweep)
    say(f"coserve: {MODEL} served by vLLM on core {args.server_core} (priority scheduling, max_num_seqs {args.max_num_seqs}, "
        f"KV {KV_CACHE_BYTES / 1e9:.0f} GB), clients on core {args.client_core}; phases "
        + ", ".join(f"{p.name} {p.rate:g}/s" for p in phases) + f", {args.phase_s:.0f} s each; {len(arrivals)} online requests "
        f"(max_tokens {ONLINE_MAX_TOKENS[0]}-{ONLINE_MAX_TOKENS[1]}), {pq.read_metadata(batch_file).num_rows} batch rows "
        f"(max_tokens {BATCH_MAX_TOKENS}, priority {BATCH_PRIORITY}); windows {args.window_s:.0f} s; sides alone, "
        f"{', '.join(args.sides)}; planned about {likely / 60:.0f} min"
        + (f" (if the sweep stops by 4 in flight; at most {most / 60:.0f} min)" if most > likely else ""))

    model_dir = SMOLLM2_135M.prepare(batchllm_home())
    server_log = workdir / "server.log"
    server = start_server(model_dir, args.port, args.server_core, args.max_num_seqs, server_log, args.max_num_batched_tokens)
    try:
        say(f"server healthy after {wait_healthy(base, server, server_log):.0f} s")
        os.sched_setaffinity(0, {args.client_core})  # this process and every batch process it starts from here on
        warm_up(base, online_pool, batch_prompts)
        note = reset_server(base)
        if note:
            say(f"warning: {note}")
        run_all(args, sweep, say, workdir, base, phases, arrivals, batch_file)
    except BaseException:
        if server.poll() is not None:
            say(f"server log:\n{tail(server_log)}")
        raise
    finally:
        stop_process(server, signal.SIGTERM)


def run_all(args, sweep, say: Report, workdir: Path, base: str, phases: list[Phase], arrivals: list[Arrival],
            batch_file: Path) -> None:
    runs: dict[str, SideRun] = {}
    say()
    side_header(say)
    runs["alone"] = alone = run_side("alone", base, phases, arrivals, None, workdir)
    report_side(say, alone)
    heavy = phase_stats(alone)[1]
    reference = LatencySlo(heavy["ttft_p99"], heavy["itl_p99"])
    slo = scaled(reference, BASELINE_MARGIN)
    say(f"{'':<10} SLO = {BASELINE_MARGIN}x alone's heavy-phase p99: TTFT {slo.ttft_p99_s * 1000:.0f} ms, "
        f"inter-token {slo.itl_p99_s * 1000:.1f} ms")

    if "fixed" in args.sides:
        runs["fixed"] = run_side(f"fixed{args.max_num_seqs}", base, phases, arrivals,
                                 fixed_client_command(base, batch_file, args.max_num_seqs), workdir)
        report_side(say, runs["fixed"])
    if "oracle" in args.sides:
        oracle = sweep_fixed(args, sweep, phases, arrivals, say, workdir, base, batch_file, reference)
        if oracle is not None:
            runs["oracle"] = oracle
    if "batchllm" in args.sides:
        dag = write_dag(workdir, batch_file, base, slo, args.max_num_seqs)
        command = batchllm_command(args.batchllm, dag, workdir / "batchllm-out", args.batchllm_args)
        say(f"{'':<10} batchllm: {shlex.join(command)}")
        try:
            runs["batchllm"] = run_side("batchllm", base, phases, arrivals, command, workdir)
            report_side(say, runs["batchllm"])
        except RuntimeError as error:
            say(f"batchllm side failed: {error}")
    summary(args, say, runs, reference)


def sweep_fixed(args, sweep: list[int], phases: list[Phase], arrivals: list[Arrival], say: Report, workdir: Path, base: str,
                batch_file: Path, reference: LatencySlo) -> SideRun | None:
    """The run of the largest fixed concurrency that keeps the SLO in the heavy phase's windows, over all phases (the
    windows batchllm is judged on), up to the first that breaks it; None when even 1 in flight breaks it. A p99 over
    a short heavy-only run is kinder: the concurrency it picks often broke a window of the full run
    (benchmarks/results/coserve-guard-band-2026-11-26.txt)."""
    heavy = next(p for p in phases if p.name == "heavy")
    best, kept_run = 0, None
    for concurrency in sweep:
        run = run_side(f"sweep{concurrency}", base, phases, arrivals, fixed_client_command(base, batch_file, concurrency), workdir)
        report_side(say, run)
        windows = window_stats(run, args.window_s)
        judged = [w for w in windows if w["lo"] < heavy.end_s and w["hi"] > heavy.start_s]
        kept = sum(1 for w in judged if kept_window(w, reference))
        say(f"{'':<10} per window " + " ".join(window_cell(w, reference) for w in windows) + f"; the heavy phase's: {kept}/{len(judged)} kept, "
            + ("keeps the SLO" if kept == len(judged) else "breaks the SLO"))
        if kept < len(judged):
            break
        best, kept_run = concurrency, replace(run, name=f"oracle{concurrency}")
    say(f"{'':<10} best safe fixed concurrency: {best or 'none (even 1 in flight breaks the SLO)'}")
    return kept_run


def window_cell(window: dict, reference: LatencySlo) -> str:
    """`1.02/0.97*`: a window's p99 TTFT and ITL over the reference, * when it breaks the SLO."""
    return (f"{window['ttft_p99'] / reference.ttft_p99_s:.2f}/{window['itl_p99'] / reference.itl_p99_s:.2f}"
            f"{'' if kept_window(window, reference) else '*'}")


def summary(args, say: Report, runs: dict[str, SideRun], reference: LatencySlo) -> None:
    say()
    say(f"SLO per {args.window_s:.0f} s window after the first (p99, worst window over alone's heavy-phase p99; SLO 1.25x):")
    say(f"{'side':<10} {'TTFT':>6} {'ITL':>6} {'windows kept':>13} {'batch tok/s (all phases)':>25}")
    windows = {name: window_stats(run, args.window_s) for name, run in runs.items()}
    worsts = {}
    for name, run in runs.items():
        worsts[name] = worst_window(windows[name], reference)
        ttft, itl, kept, total = worsts[name]
        say(f"{run.name:<10} {ttft:5.2f}x {itl:5.2f}x {kept:>6}/{total:<6} {batch_rate(run):25.1f}")
    say()
    say("per window (p99 over alone's heavy-phase p99, TTFT/ITL; * breaks the SLO; then the batch requests the server ran):")
    for name, run in runs.items():
        cells = [window_cell(w, reference) for w in windows[name]]
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
        versus = "n/a" if gain is None else "yes" if gain >= 1.2 else "no"
        say(f"targets: batchllm keeps the SLO in every window: {'yes' if kept == total else 'no'} ({kept}/{total}); "
            f"batch >= 1.2x the oracle's: {versus}")
    say(f"total runtime: {time.monotonic() - args.started:.0f} s")
    b_ttft, b_itl = worsts["batchllm"][:2] if "batchllm" in worsts else (None, None)
    f_ttft, f_itl = worsts["fixed"][:2] if "fixed" in worsts else (None, None)
    say(f"online p99 TTFT {times(b_ttft)}, inter-token {times(b_itl)} of alone (worst window); batch {times(gain)} the best safe "
        f"fixed concurrency; fixed client p99 TTFT {times(f_ttft)}, inter-token {times(f_itl)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["fixed-client"]:
        fixed_client_main(sys.argv[2:])
    else:
        main()
