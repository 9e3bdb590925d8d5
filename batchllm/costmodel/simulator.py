"""Iteration-level simulation of one vLLM replica's continuous batching. No vLLM import.

Scheduler rules modelled (vLLM v1, FCFS): every step, running requests go first,
each decoding request takes one token of the step's token budget and prefilling ones
take a chunk of what is left (chunked prefill); then waiting requests are admitted in
arrival order while the budget, `max_num_seqs` and the KV cache allow. A prompt's
prefix-cached tokens are not computed (at least its last token is). When the KV cache
overflows, the most recently admitted request is preempted and later recomputed with
its output so far as part of its prompt.

Invariant that makes it fast: all decoding requests advance together, one token a
step, so they share one clock. A request that starts decoding at clock D0 with r
tokens to go finishes at clock D0 + r (a heap of finish clocks), and a run of steps in
which nothing but decoding happens is advanced in one jump to the next event (a finish,
a KV overflow or an arrival), its time summed in closed form.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from batchllm.costmodel.latency import StepFeatures, StepLatencyModel


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_capacity_tokens: int
    block_size_tokens: int

    def __post_init__(self):
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})")


class TraceSegment(NamedTuple):
    """`steps` consecutive steps with the same running count; times in seconds."""

    start_s: float
    steps: int
    running: int
    prefill_tokens: int
    duration_s: float


@dataclass(frozen=True)
class SimulationResult:
    total_s: float
    finish_s: np.ndarray  # per request, seconds from the start
    steps: int
    preemptions: int
    trace: list[TraceSegment]


class _Replica:
    def __init__(self, prompt, output, cached, ready_s, limits: SchedulerLimits, latency: StepLatencyModel, jump: bool):
        self.jump = jump
        # Per-request state lives in plain lists: element access is what the loop does.
        self.limits, self.latency = limits, latency
        prompt = np.asarray(prompt, np.int64)
        left = np.maximum(prompt - np.minimum(np.asarray(cached, np.int64), prompt - 1), 1)
        self.prompt = prompt.tolist()
        self.target = np.asarray(output, np.int64).clip(min=1).tolist()
        self.left = left.tolist()
        self.computed = (prompt - left).tolist()  # tokens whose KV exists (cached prefix counts)
        self.ready_s = np.asarray(ready_s, float).tolist()
        self.arrivals = deque(np.argsort(ready_s, kind="stable").tolist())
        self.waiting: deque[int] = deque()
        self.prefilling: list[int] = []  # admission order
        self.decoding: set[int] = set()
        self.admitted: dict[int, None] = {}  # running requests in admission order (preemption picks the last)
        self.heap: list[tuple[int, int]] = []  # (finish clock, request)
        self.start_clock = [0] * len(self.prompt)
        self.generated_at_start = [0] * len(self.prompt)
        self.clock = 0
        self.decode_base = 0  # sum over decoders of (kv tokens at start - start clock)
        self.kv_other = 0  # kv tokens of prefilling requests
        self.now = 0.0
        self.steps = 0
        self.preemptions = 0
        self.finish_s = [float("nan")] * len(self.prompt)
        self.trace: list[tuple] = []  # TraceSegment fields; made into records once, at the end

    # -- bookkeeping -------------------------------------------------------
    def kv_tokens(self) -> int:
        running = len(self.decoding) + len(self.prefilling)
        return self.decode_base + len(self.decoding) * self.clock + self.kv_other + running * (self.limits.block_size_tokens // 2)

    def decode_context(self) -> int:
        return self.decode_base + len(self.decoding) * self.clock

    def _decoder_offset(self, r: int) -> int:
        """A decoder's KV tokens are this offset plus the shared clock."""
        return self.prompt[r] + self.generated_at_start[r] - self.start_clock[r]

    def start_decoding(self, r: int, generated: int) -> None:
        self.decoding.add(r)
        self.start_clock[r], self.generated_at_start[r] = self.clock, generated
        self.decode_base += self._decoder_offset(r)
        heapq.heappush(self.heap, (self.clock + self.target[r] - generated, r))

    def finish(self, r: int) -> None:
        self.finish_s[r] = self.now
        del self.admitted[r]

    def arrive(self) -> None:
        while self.arrivals and self.ready_s[self.arrivals[0]] <= self.now + 1e-12:
            self.waiting.append(self.arrivals.popleft())

    # -- one explicit step (prefill work present) -------------------------
    def step(self) -> None:
        budget = self.limits.max_num_batched_tokens - len(self.decoding)
        chunks: list[tuple[int, int]] = []
        prefill_tokens = prefill_attention = 0
        for r in self.prefilling:
            if budget <= 0:
                break
            chunk = min(self.left[r], budget)
            chunks.append((r, chunk))
            prefill_tokens += chunk
            prefill_attention += chunk * (self.computed[r] + chunk)
            budget -= chunk
        free_kv = self.limits.kv_capacity_tokens - self.kv_tokens()
        half_block = self.limits.block_size_tokens // 2
        while self.waiting and budget > 0 and len(self.admitted) < self.limits.max_num_seqs:
            r = self.waiting[0]
            chunk = min(self.left[r], budget)
            need = self.computed[r] + chunk + half_block
            if need > free_kv:
                break
            self.waiting.popleft()
            self.prefilling.append(r)
            self.admitted[r] = None
            self.kv_other += self.computed[r]
            free_kv -= need
            chunks.append((r, chunk))
            prefill_tokens += chunk
            prefill_attention += chunk * (self.computed[r] + chunk)
            budget -= chunk
        if not chunks and not self.decoding:
            r = self.waiting[0]
            raise ValueError(f"request {r} needs {self.prompt[r]} tokens of KV cache; the replica has {self.limits.kv_capacity_tokens}")
        features = StepFeatures(prefill_tokens, prefill_attention, len(self.decoding), self.decode_context())
        duration = self.latency.step_s(features)
        self._record(1, prefill_tokens, duration)
        self.clock += 1
        for r, chunk in chunks:
            self.left[r] -= chunk
            self.computed[r] += chunk
            self.kv_other += chunk
            if self.left[r] == 0:  # prompt done: this step produced its first token
                self.prefilling.remove(r)
                self.kv_other -= self.computed[r]
                if self.target[r] <= 1:
                    self.finish(r)
                else:
                    self.start_decoding(r, 1)
        self._pop_finished()

    # -- a jump over pure-decode steps ------------------------------------
    def decode_jump(self) -> None:
        seqs = len(self.decoding)
        steps = self.heap[0][0] - self.clock
        room = self.limits.kv_capacity_tokens - self.kv_tokens()
        steps = max(1, min(steps, room // seqs)) if room > 0 else 1
        if self.arrivals and len(self.admitted) < self.limits.max_num_seqs:
            until_arrival = self.ready_s[self.arrivals[0]] - self.now
            steps = max(1, min(steps, self.latency.decode_steps_within(seqs, self.decode_context(), until_arrival) + 1))
        duration = self.latency.decode_run_s(seqs, self.decode_context(), steps)
        self._record(steps, 0, duration)
        self.clock += steps
        self._pop_finished()
        if self.kv_tokens() > self.limits.kv_capacity_tokens:
            self._preempt()

    def _pop_finished(self) -> None:
        while self.heap and self.heap[0][0] <= self.clock:
            _, r = heapq.heappop(self.heap)
            self.decoding.discard(r)
            self.decode_base -= self._decoder_offset(r)
            self.finish(r)

    def _preempt(self) -> None:
        while self.kv_tokens() > self.limits.kv_capacity_tokens and len(self.admitted) > 1:
            victim = next(reversed(self.admitted))
            del self.admitted[victim]
            self.preemptions += 1
            if victim in self.decoding:
                generated = self.generated_at_start[victim] + self.clock - self.start_clock[victim]
                self.decoding.discard(victim)
                self.decode_base -= self._decoder_offset(victim)
                self.heap = [(c, r) for c, r in self.heap if r != victim]
                heapq.heapify(self.heap)
                self.prompt[victim] += generated  # recompute prompt + output so far
                self.target[victim] -= generated
            else:
                self.prefilling.remove(victim)
                self.kv_other -= self.computed[victim]
            self.left[victim] = self.prompt[victim]
            self.computed[victim] = 0
            self.waiting.appendleft(victim)

    def _record(self, steps: int, prefill_tokens: int, duration: float) -> None:
        running = len(self.decoding) + len(self.prefilling)
        self.trace.append((self.now, steps, running, prefill_tokens, duration))
        self.now += duration
        self.steps += steps

    def run(self) -> SimulationResult:
        while True:
            self.arrive()
            if not self.admitted and not self.waiting:
                if not self.arrivals:
                    break
                self.now = float(self.ready_s[self.arrivals[0]])
                continue
            admissible = self.waiting and len(self.admitted) < self.limits.max_num_seqs
            if not self.jump or self.prefilling or (admissible and self._fits(self.waiting[0])) or not self.decoding:
                self.step()
                if self.kv_tokens() > self.limits.kv_capacity_tokens:
                    self._preempt()
            else:
                self.decode_jump()
        trace = [TraceSegment(*segment) for segment in self.trace]
        return SimulationResult(self.now, np.array(self.finish_s), self.steps, self.preemptions, trace)

    def _fits(self, r: int) -> bool:
        first_chunk = min(self.left[r], self.limits.max_num_batched_tokens - len(self.decoding))
        need = self.computed[r] + first_chunk + self.limits.block_size_tokens // 2
        return need <= self.limits.kv_capacity_tokens - self.kv_tokens()


def simulate_replica(prompt_tokens, output_tokens, limits: SchedulerLimits, latency: StepLatencyModel,
                     cached_tokens=None, ready_s=None, jump: bool = True) -> SimulationResult:
    """Simulate one replica serving the requests; arrays are per request.

    `jump=False` advances one step at a time: the slow reference the jumps must match.
    """
    count = len(prompt_tokens)
    cached = np.zeros(count, np.int64) if cached_tokens is None else cached_tokens
    ready = np.zeros(count) if ready_s is None else ready_s
    if count == 0:
        return SimulationResult(0.0, np.zeros(0), 0, 0, [])
    return _Replica(prompt_tokens, output_tokens, cached, ready, limits, latency, jump).run()
