"""A server that already serves a model, driven as an `Engine`: requests go out as streamed
OpenAI calls (so a stopped run aborts them on the server), results come back as they end.

How many run at once is the latency guard's call (`in_flight_limit`), read from the
server's metrics every SCRAPE_S beside its online traffic, and from how long the quietest of its
own decoding streams has gone without a token (a stalled server shows there before any answer ends). When the guard cuts below what is
on the server, the youngest calls over its allowance are aborted at once (they have done the
least) and held here until it allows them again, then sent anew: a cut takes effect in a
scrape, not after the calls in flight end (~one answer's time, when online latency is already
over its target). A failed attempt is judged in `attempt_failure`: the row's error, the engine's
failure, or sent again with backoff (under a new attempt id: vLLM takes `X-Request-Id` as the
request's id, and the aborted attempt may still hold the old one). A server down for longer than
`down_after_s` fails the engine with the cause: its unfinished requests go back to the
runtime, which sends them to the model's other servers or fails the node.

Invariant: every submitted request ends exactly once here, as a result or with the
engine's failure; none is answered twice (a retry or a resend after a hold starts only after
its attempt ended). Submitted = on the server + held + in a retry's backoff.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import httpx

from batchllm.core.endpoint import Endpoint
from batchllm.core.requests import EngineRequest, EngineResult
from batchllm.engines.endpoint.attempt_failure import Next, judge_failure
from batchllm.engines.endpoint.guard_log import GuardLog
from batchllm.engines.endpoint.latency_guard import LatencyGuard
from batchllm.engines.endpoint.request_body import StreamedAnswer, request_body
from batchllm.engines.endpoint.server_metrics import metrics_url, scrape
from batchllm.engines.engine import Engine, EngineFactory, EngineFailed
from batchllm.engines.protocol import EngineConfig, StepRecord, WorkerReady

SCRAPE_S = 1.0
CALL_TIMEOUT_S = 600.0  # one call, from sending it to its last token
OWN_TIMINGS_S = 0.5  # how often a streaming request tells the guard the gaps between its tokens
DOWN_AFTER_S = 120.0  # a server that answers nothing for this long fails its engine (a restart takes ~30 s here)
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
HELD_POLL_S = 0.25  # how often a request held back by a cut asks the guard again
CHAT_KEYS = frozenset({"model", "messages", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "seed", "stop",
                       "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "response_format"})
COMPLETION_KEYS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "seed",
                             "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"})


class EndpointEngine:
    def __init__(self, config: EngineConfig, *, down_after_s: float = DOWN_AFTER_S, guard: LatencyGuard | None = None):
        """`guard`: how many may be in flight (default: a `LatencyGuard` on the endpoint's SLO)."""
        if config.endpoint is None:
            raise ValueError(f"{config.model}: an endpoint engine needs config.endpoint")
        self.config, self.endpoint = config, config.endpoint
        self._down_after_s = down_after_s
        self._results: queue.Queue[EngineResult] = queue.Queue()
        self._failure: EngineFailed | None = None
        self._down_since: float | None = None
        self._in_flight = 0  # submitted, not yet ended
        self._held = 0  # of those, aborted by a cut and waiting to be allowed again
        self._calls: dict[int | str, tuple[float, asyncio.Task]] = {}  # request id -> (sent at, its call): on the server; loop thread only
        self._cut_back: set[int | str] = set()  # request ids whose call a cut aborted; loop thread only
        self._last_token_at: dict[int | str, float] = {}  # request id -> when its stream last brought tokens; loop thread only
        self._lock = threading.Lock()
        self._guard = guard or LatencyGuard(self.endpoint.slo, self.endpoint.max_in_flight)
        self._guard_log = GuardLog(config.log_path, self.endpoint.url)  # written under the lock: by the loop thread, last at stop
        self._ready = WorkerReady(load_time_s=0.0, kv_capacity_tokens=0, block_size_tokens=16,
                                  max_num_seqs=self.endpoint.max_in_flight, max_num_batched_tokens=0,
                                  max_model_len=self.endpoint.max_model_len or 0,
                                  engine_version=f"{self.endpoint.server_kind} server {self.endpoint.url}")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"endpoint {self.endpoint.url}", daemon=True)
        self._thread.start()
        self._tasks: set[concurrent.futures.Future] = set()
        import openai  # about 1.5 s of imports, paid by a run with a server only

        self._client = openai.AsyncOpenAI(base_url=self.endpoint.url, api_key=self.endpoint.api_key(), max_retries=0,
                                          timeout=CALL_TIMEOUT_S)
        self._metrics = httpx.Client(timeout=2.0, headers=self.endpoint.headers())
        self._scraper = asyncio.run_coroutine_threadsafe(self._scrape_forever(), self._loop)

    # -- the Engine protocol ----------------------------------------------------------------
    @property
    def ready(self) -> WorkerReady:
        return self._ready

    def in_flight_limit(self) -> int:
        with self._lock:
            return self._guard.allowed(time.monotonic(), self._on_server())

    def note(self) -> str | None:
        with self._lock:
            return f"{self.endpoint.url}: {self._guard.reading(time.monotonic()).describe()}"

    def submit(self, requests: Sequence[EngineRequest]) -> None:
        with self._lock:
            self._in_flight += len(requests)
            self._guard.allowed(time.monotonic(), self._on_server())  # the guard learns how many run
        for request in requests:
            self._tasks.add(asyncio.run_coroutine_threadsafe(self._answer(request), self._loop))

    def poll(self, timeout_s: float) -> list[EngineResult]:
        if self._failure is not None:
            raise self._failure
        results: list[EngineResult] = []
        try:
            results.append(self._results.get(timeout=timeout_s) if timeout_s > 0 else self._results.get_nowait())
            while True:
                results.append(self._results.get_nowait())
        except queue.Empty:
            pass
        self._tasks = {t for t in self._tasks if not t.done()}
        return results

    def drain_steps(self) -> list[StepRecord]:
        return []  # the server's iterations are its own

    def stop(self) -> None:
        """Abort what is in flight (closing a stream aborts its request on the server), then
        end the loop thread and close what it held."""
        async def close() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._client.close()
            await self._loop.shutdown_default_executor()

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10.0)
            except Exception:  # noqa: BLE001  stopping: nothing left to report to
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        self._metrics.close()
        with self._lock:
            self._log_guard_changes()
        self._guard_log.close()

    # -- one request ------------------------------------------------------------------------
    async def _answer(self, request: EngineRequest) -> None:
        try:
            await self._answer_once(request)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001  a fault here would leave the request unanswered for ever
            self._failure = self._failure or EngineFailed(f"server {self.endpoint.url}", f"{type(error).__name__}: {error}")
        finally:
            with self._lock:
                self._in_flight -= 1

    async def _answer_once(self, request: EngineRequest) -> None:
        try:
            request_body(request, self.endpoint.served_model, self.endpoint.server_kind, self.endpoint.priority)
        except ValueError as error:  # a request this server cannot take: that row's error
            self._results.put(EngineResult.failed(request.request_id, 0, str(error)))
            return
        attempt = retries = failed_answers = 0  # attempt: sent so far (its id); retries: after a failure (the backoff)
        while True:
            try:
                result = await self._guarded_call(request, attempt)
            except CutBack:  # the guard's cut aborted it: sent again, as a new attempt, once allowed
                attempt += 1
                await self._until_allowed()
                continue
            except Exception as error:  # noqa: BLE001  judged in attempt_failure: the row's, the engine's, or a retry
                judgement = judge_failure(error, failed_answers)
                if judgement.next is Next.ENGINE_FAILS:  # the server's fault, not the row's: every row would get it
                    self._failure = self._failure or EngineFailed(f"server {self.endpoint.url}", judgement.why)
                    return
                if judgement.next is Next.ROW_FAILS:
                    self._results.put(EngineResult.failed(request.request_id, 0, judgement.why))
                    return
                cause, failed_answers = judgement.why, judgement.failed_answers
            else:
                self._results.put(result)
                return
            now = time.monotonic()
            with self._lock:
                self._down_since = self._down_since or now
                down_s = now - self._down_since
            if down_s > self._down_after_s:
                self._failure = self._failure or EngineFailed(f"server {self.endpoint.url}", f"no answer for {down_s:.0f} s: {cause}")
                return
            await asyncio.sleep(BACKOFF_S[min(retries, len(BACKOFF_S) - 1)])
            attempt, retries = attempt + 1, retries + 1

    async def _guarded_call(self, request: EngineRequest, attempt: int) -> EngineResult:
        """`_call` as a task a cut can abort (`_cut_back_youngest`): CutBack then."""
        call = asyncio.ensure_future(self._call(request, attempt))
        self._calls[request.request_id] = (time.monotonic(), call)
        held = False
        try:
            return await call
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if request.request_id in self._cut_back and not (current is not None and current.cancelling()):
                held = True
                raise CutBack from None
            call.cancel()
            raise
        finally:
            del self._calls[request.request_id]
            if request.request_id in self._cut_back:
                self._cut_back.discard(request.request_id)
                if not held:  # it ended (answer or error) before the abort reached it: not held after all
                    with self._lock:
                        self._held -= 1

    async def _until_allowed(self) -> None:
        """Wait, held, until the guard allows one more on the server; then it counts as there
        (also when the wait ends otherwise: a stop cancels it, and the request ends)."""
        try:
            while True:
                with self._lock:
                    on_server = self._on_server()
                    if on_server < self._guard.allowed(time.monotonic(), on_server):
                        return
                await asyncio.sleep(HELD_POLL_S)
        finally:
            with self._lock:
                self._held -= 1

    def _log_guard_changes(self) -> None:
        """The guard's changes since the last call into its log (the caller holds the lock)."""
        self._guard_log.write(self._guard.changes(), time.monotonic(), dt.datetime.now(dt.UTC))

    def _on_server(self) -> int:
        """Submitted and not held back by a cut (the caller holds the lock)."""
        return self._in_flight - self._held

    def _cut_back_youngest(self) -> None:
        """Abort the youngest calls over the guard's allowance (loop thread, after a scrape)."""
        with self._lock:
            on_server = self._on_server()
            excess = on_server - self._guard.allowed(time.monotonic(), on_server)
            running = [(sent, request_id) for request_id, (sent, _) in self._calls.items() if request_id not in self._cut_back]
            youngest = sorted(running, key=lambda call: call[0], reverse=True)[:max(0, excess)]
            self._held += len(youngest)
        for _, request_id in youngest:
            self._cut_back.add(request_id)
            self._calls[request_id][1].cancel()

    async def _call(self, request: EngineRequest, attempt: int) -> EngineResult:
        """One streamed call. Its time to first token and the gaps between its tokens go to the
        guard as they happen (about once per OWN_TIMINGS_S), so that the guard can take them
        out of the server's histograms while they are in the window it reads."""
        e = self.endpoint
        body = request_body(request, e.served_model, e.server_kind, e.priority)
        known = CHAT_KEYS if request.chat else COMPLETION_KEYS
        create = self._client.chat.completions.create if request.chat else self._client.completions.create
        sent = time.monotonic()
        stream = await create(**{k: v for k, v in body.items() if k in known},
                              extra_body={k: v for k, v in body.items() if k not in known} or None,
                              extra_headers={"X-Request-Id": f"batchllm-{request.request_id}-{attempt}"})
        with self._lock:
            self._down_since = None  # it answered
        answer, last, reported, gaps = StreamedAnswer(request.n), None, sent, list[float]()
        try:
            async for chunk in stream:
                tokens = answer.add(chunk.model_dump())
                if not tokens:
                    continue
                now = time.monotonic()
                self._last_token_at[request.request_id] = now
                if last is None:  # a first chunk of k tokens: the first token, then k - 1 gaps of next to nothing
                    self._own_timings(now, now - sent, [0.0] * (tokens - 1))
                else:  # k tokens in one chunk: the server saw k gaps, the client one
                    gaps.extend([(now - last) / tokens] * tokens)
                last = now
                if gaps and now - reported >= OWN_TIMINGS_S:
                    self._own_timings(now, None, gaps)
                    reported, gaps = now, []
        finally:
            self._last_token_at.pop(request.request_id, None)
            await stream.close()
        if gaps:
            self._own_timings(time.monotonic(), None, gaps)
        if answer.finish[0] is None:
            raise CutStream("the stream ended without a finish reason")
        return answer.result(request)

    def _own_timings(self, now_s: float, ttft_s: float | None, gaps_s: list[float]) -> None:
        with self._lock:
            self._guard.observe_own(now_s, ttft_s, gaps_s)

    # -- the guard's eyes ---------------------------------------------------------------------
    async def _scrape_forever(self) -> None:
        url = metrics_url(self.endpoint.url)
        loop = asyncio.get_running_loop()
        while True:
            snapshot = await loop.run_in_executor(None, scrape, self._metrics, url, time.monotonic)
            now = time.monotonic()
            silent_s = max((now - at for at in self._last_token_at.values()), default=0.0)
            with self._lock:
                if snapshot is not None:
                    self._guard.observe_server(snapshot)
                self._guard.observe_silence(now, silent_s)
                self._log_guard_changes()
            self._cut_back_youngest()
            await asyncio.sleep(SCRAPE_S)


class CutBack(Exception):
    """A call the guard's cut aborted (held, then sent again)."""


class CutStream(Exception):
    """A stream that ended before its answer did (sent again)."""


def start_endpoint_engine(config: EngineConfig) -> EndpointEngine:
    """The engine of one server; EngineFailed when the server does not answer now."""
    assert config.endpoint is not None
    try:
        httpx.get(f"{config.endpoint.url}/models", headers=config.endpoint.headers(), timeout=5.0).raise_for_status()
    except httpx.HTTPError as error:
        raise EngineFailed(f"server {config.endpoint.url}", f"{type(error).__name__}: {error}") from None
    return EndpointEngine(config)


def with_endpoints(factory: EngineFactory) -> EngineFactory:
    """`factory` for engines on devices, an `EndpointEngine` for a config with an endpoint."""
    def start(config: EngineConfig) -> Engine:
        return start_endpoint_engine(config) if config.endpoint is not None else factory(config)
    return start


def endpoint_config(model_dir: str, endpoint: Endpoint, index: int, log_path: str | None = None) -> EngineConfig:
    """The config of a model's `index`-th server (`model_dir`: its files here, for the
    tokenizer of the prefix order; "" when there are none; `log_path`: its latency guard's log)."""
    from batchllm.engines.devices import Replica

    return replace(EngineConfig(model=model_dir, replica=Replica("endpoint", (index,)), log_path=log_path), endpoint=endpoint)
