"""A scripted in-process engine for testing orchestration logic (never used by `batchllm run`)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from batchllm.core.requests import EngineRequest, EngineResult, FinishReason, ModelTask, TokenLogprob
from batchllm.engines.engine import EngineFailed
from batchllm.engines.protocol import EngineConfig, WorkerReady
from batchllm.models.model_kind import ModelKind


def fake_text(request: EngineRequest) -> str:
    """Deterministic output: the request's prompt (or its chat's turns), tagged, so tests can
    see what was rendered."""
    if request.messages is not None:
        return "<" + " | ".join(f"{role}: {content}" for role, content in request.messages) + ">"
    return f"<{request.prompt}>"


def fake_vector(request: EngineRequest, dimensions: int) -> np.ndarray:
    """Deterministic, normalised float32: a function of the prompt, so tests can check which row got which."""
    seed = int.from_bytes(hashlib.sha256(request.prompt.encode()).digest()[:8], "little")
    vector = np.random.default_rng(seed).standard_normal(dimensions).astype(np.float32)
    return vector / np.linalg.norm(vector)


def fake_probs(request: EngineRequest, labels: int) -> np.ndarray:
    """A classify request's: a softmax of a fake vector of its text, one probability a label."""
    weights = np.exp(4 * fake_vector(request, labels).astype(np.float64))
    return (weights / weights.sum()).astype(np.float32)


def fake_score(request: EngineRequest, dimensions: int) -> float:
    """A score request's: the cosine of the fake vectors of its text and its pair."""
    assert request.pair is not None
    pair = EngineRequest(request.request_id, request.pair, chat=False)
    return float(fake_vector(request, dimensions).astype(np.float64) @ fake_vector(pair, dimensions).astype(np.float64))


def fake_logprobs(text: str, top: int) -> tuple[TokenLogprob, ...]:
    """A token per character, each with log probability -0.5 (and `top` alternatives)."""
    return tuple(TokenLogprob(c, -0.5, tuple((c if k == 0 else f"alt{k}", -0.5 - k) for k in range(top))) for c in text)


class FakeEngine:
    VECTOR_DIMENSIONS = 8  # what an EMBED config's engine gives (the tests' BertModel directory says hidden_size 8)

    def __init__(self, config: EngineConfig, *, die_after: int | None = None, per_poll: int = 3, answer=fake_text):
        self.config, self.answer = config, answer
        self.ready = WorkerReady(0.0, 10_000, 16, 8, 64, 512, "fake")
        self.queue: list[EngineRequest] = []
        self.seen: list[EngineRequest] = []
        self.most_queued = 0  # the most requests it held at once
        self.stopped = False
        self._die_after, self._per_poll, self._answered = die_after, per_poll, 0

    def in_flight_limit(self) -> int:
        return self.ready.max_num_seqs

    def note(self) -> str | None:
        return None

    def submit(self, requests) -> None:
        self.queue.extend(requests)
        self.seen.extend(requests)
        self.most_queued = max(self.most_queued, len(self.queue))

    def poll(self, timeout_s: float) -> list[EngineResult]:
        if self._die_after is not None and self._answered >= self._die_after:
            raise EngineFailed("fake engine", "died")
        batch, self.queue = self.queue[: self._per_poll], self.queue[self._per_poll:]
        results = []
        for request in batch:
            if self._die_after is not None and self._answered >= self._die_after:
                break  # like the real engine: what was delivered is kept, the failure comes next
            self._answered += 1
            if self.config.task in (ModelTask.EMBED, ModelTask.CLASSIFY) and request.pair is not None:  # a score of two texts
                results.append(EngineResult(request.request_id, ("",), len(request.prompt) + len(request.pair), 0, FinishReason.STOP,
                                            score=fake_score(request, self.VECTOR_DIMENSIONS)))
                continue
            if self.config.task is ModelTask.EMBED:
                results.append(EngineResult(request.request_id, ("",), len(request.prompt), 0, FinishReason.STOP,
                                            vector=fake_vector(request, self.VECTOR_DIMENSIONS)))
                continue
            if self.config.task is ModelTask.CLASSIFY:  # the labels of the model directory's config
                probs = fake_probs(request, len(labels := ModelKind.of(Path(self.config.model)).labels))
                results.append(EngineResult(request.request_id, (labels[int(probs.argmax())],), len(request.prompt), 0,
                                            FinishReason.STOP, vector=probs))
                continue
            text = self.answer(request)
            logprobs = fake_logprobs(text, request.sampling.top_logprobs) if request.sampling.logprobs else None
            results.append(EngineResult(request.request_id, (text,) * request.n, len(request.prompt), len(text), FinishReason.STOP,
                                        logprobs=logprobs))
        return results

    def drain_steps(self) -> list:
        return []

    def stop(self) -> None:
        self.stopped = True


class FakeEngineFactory:
    """Records every engine it starts; `die_after` scripts failures per start, in order."""

    def __init__(self, die_after: list[int | None] | None = None, crash_after_results: int | None = None, answer=fake_text):
        """`answer`: request -> the text every completion of it gets."""
        self.started: list[FakeEngine] = []
        self._answer = answer
        self._die_after = list(die_after or [])
        self._crash_after = crash_after_results

    def __call__(self, config: EngineConfig) -> FakeEngine:
        die_after = self._die_after.pop(0) if self._die_after else None
        engine = FakeEngine(config, die_after=die_after, answer=self._answer)
        if self._crash_after is not None:
            engine = _CrashingEngine(engine, self._crash_after)
        self.started.append(engine)
        return engine

    @property
    def requests(self) -> list[EngineRequest]:
        return [r for e in self.started for r in e.seen]


class DriverCrash(BaseException):
    """Stands in for the driver being killed: not an Exception, so nothing catches it."""


class _CrashingEngine:
    """Kills the 'driver' (raises DriverCrash) once `limit` results have been handed over."""

    def __init__(self, inner: FakeEngine, limit: int):
        self._inner, self._limit, self._given = inner, limit, 0
        self.config, self.ready = inner.config, inner.ready
        self.seen = inner.seen

    def in_flight_limit(self) -> int:
        return self.ready.max_num_seqs

    def note(self) -> str | None:
        return None

    def submit(self, requests) -> None:
        self._inner.submit(requests)

    def poll(self, timeout_s: float) -> list[EngineResult]:
        if self._given >= self._limit:
            raise DriverCrash()
        results = self._inner.poll(timeout_s)[: self._limit - self._given]
        self._given += len(results)
        return results

    def drain_steps(self) -> list:
        return []

    def stop(self) -> None:
        self._inner.stop()


class FakeStepper:
    """Runs inside a real worker process in place of vLLM: one request finishes per step.

    `fail_at_step` makes step N raise, to test how failures cross the process boundary.
    """

    def __init__(self, config: EngineConfig, fail_at_step: int | None = None):
        from batchllm.engines.protocol import WorkerReady

        self.ready = WorkerReady(0.0, 1000, 16, 8, 64, 512, "fake")
        self._queue: list[EngineRequest] = []
        self._steps, self._fail_at = 0, fail_at_step

    def add(self, request: EngineRequest):
        self._queue.append(request)

    def has_work(self) -> bool:
        return bool(self._queue)

    def step(self):
        from batchllm.engines.protocol import StepRecord

        self._steps += 1
        if self._fail_at is not None and self._steps >= self._fail_at:
            raise RuntimeError(f"fake stepper broke at step {self._steps}")
        request = self._queue.pop(0)
        text = fake_text(request)
        result = EngineResult(request.request_id, (text,), len(request.prompt), len(text), FinishReason.STOP)
        return [result], StepRecord(0.001, len(request.prompt), 1, len(self._queue), 0, 0, 0)


class FakeStepperFactory:
    def __init__(self, fail_at_step: int | None = None, makes_a_lock: bool = False):
        self.fail_at_step, self.makes_a_lock = fail_at_step, makes_a_lock

    def __call__(self, config: EngineConfig) -> FakeStepper:
        if self.makes_a_lock:  # as vLLM's progress bars (tqdm) do in the worker: a named semaphore the worker must unlink
            import multiprocessing

            self.lock = multiprocessing.get_context("spawn").RLock()
        return FakeStepper(config, self.fail_at_step)
