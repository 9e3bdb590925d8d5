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
import numpy.typing as npt

from batchllm.costmodel.latency import StepLatencyModel


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_capacity_tokens: int
    block_size_tokens: int

    def __post_init__(self) -> None:
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


def _simulate(prompt: np.ndarray | list[int], output: npt.ArrayLike, cached: npt.ArrayLike, ready_s: npt.ArrayLike, limits: SchedulerLimits, latency: StepLatencyModel, jump: bool) -> SimulationResult:
    """The scheduler loop, written as one function over local variables: it runs once per
    event (a finish, an admission, a prefill chunk), so attribute and call overhead count."""
    prompt_arr = np.asarray(prompt, np.int64)
    left_arr = np.maximum(prompt_arr - np.minimum(np.asarray(cached, np.int64), prompt_arr - 1), 1)
    prompt = prompt_arr.tolist()
    target = np.asarray(output, np.int64).clip(min=1).tolist()
    left = left_arr.tolist()
    computed = (prompt_arr - left_arr).tolist()  # tokens whose KV exists (a cached prefix counts)
    ready = np.asarray(ready_s, float).tolist()
    arrivals = deque(np.argsort(ready_s, kind="stable").tolist())
    count = len(prompt)
    start_clock, generated_at_start = [0] * count, [0] * count
    decoding = [False] * count
    epoch = [0] * count  # bumped on preemption: heap entries of an older epoch are stale
    finish_s = [float("nan")] * count

    max_seqs, budget_total, capacity = limits.max_num_seqs, limits.max_num_batched_tokens, limits.kv_capacity_tokens
    half_block = limits.block_size_tokens // 2  # expected unused tail of a request's last block
    c0, c_prefill, c_attention = latency.base_s, latency.per_prefill_token_s, latency.per_attention_unit_s
    c_seq, c_context = latency.per_decode_seq_s, latency.per_context_token_s

    waiting: deque[int] = deque()
    prefilling: list[int] = []  # admission order
    admitted: dict[int, None] = {}  # running requests in admission order (preemption takes the last)
    heap: list[tuple[int, int, int]] = []  # (finish clock, request, epoch) of decoding requests
    n_dec = 0
    clock = 0  # decode steps so far: every decoding request advances one token a step
    decode_base = 0  # sum over decoders of (kv tokens when they started decoding - that clock)
    kv_other = 0  # kv tokens of prefilling requests
    now, steps, preemptions = 0.0, 0, 0
    trace: list[tuple] = []

    while True:
        while arrivals and ready[arrivals[0]] <= now + 1e-12:
            waiting.append(arrivals.popleft())
        if not admitted and not waiting:
            if not arrivals:
                break
            now = ready[arrivals[0]]
            continue
        n_run = len(admitted)
        decode_context = decode_base + n_dec * clock
        kv = decode_context + kv_other + n_run * half_block
        fits = False
        if waiting and n_run < max_seqs:
            w = waiting[0]
            fits = computed[w] + min(left[w], budget_total - n_dec) + half_block <= capacity - kv
        while heap and heap[0][2] != epoch[heap[0][1]]:
            heapq.heappop(heap)
        if jump and n_dec and not prefilling and not fits:
            # -- a jump over pure-decode steps, to the next finish, KV overflow or arrival
            run = heap[0][0] - clock
            room = capacity - kv
            run = max(1, min(run, room // n_dec)) if room > 0 else 1
            if arrivals and n_run < max_seqs:
                run = max(1, min(run, latency.decode_steps_within(n_dec, decode_context, ready[arrivals[0]] - now) + 1))
            duration = run * (c0 + c_seq * n_dec + c_context * decode_context) + c_context * n_dec * run * (run - 1) / 2
            trace.append((now, run, n_run, 0, duration))
            now += duration
            steps += run
            clock += run
        else:
            # -- one explicit step: decodes, prefill chunks of running requests, admissions
            budget = budget_total - n_dec
            chunks: list[tuple[int, int]] = []
            prefill_tokens = prefill_attention = 0
            for r in prefilling:
                if budget <= 0:
                    break
                chunk = min(left[r], budget)
                chunks.append((r, chunk))
                prefill_tokens += chunk
                prefill_attention += chunk * (computed[r] + chunk)
                budget -= chunk
            free_kv = capacity - kv
            while waiting and budget > 0 and len(admitted) < max_seqs:
                r = waiting[0]
                chunk = min(left[r], budget)
                need = computed[r] + chunk + half_block
                if need > free_kv:
                    break
                waiting.popleft()
                prefilling.append(r)
                admitted[r] = None
                kv_other += computed[r]
                free_kv -= need
                chunks.append((r, chunk))
                prefill_tokens += chunk
                prefill_attention += chunk * (computed[r] + chunk)
                budget -= chunk
            if not chunks and not n_dec:
                r = waiting[0]
                raise ValueError(f"request {r} needs {prompt[r]} tokens of KV cache; the replica has {capacity}")
            duration = (c0 + c_prefill * prefill_tokens + c_attention * prefill_attention
                        + c_seq * n_dec + c_context * decode_context)
            trace.append((now, 1, n_dec + len(prefilling), prefill_tokens, duration))
            now += duration
            steps += 1
            clock += 1
            for r, chunk in chunks:
                left[r] -= chunk
                computed[r] += chunk
                kv_other += chunk
                if left[r] == 0:  # prompt done: this step produced its first token
                    prefilling.remove(r)
                    kv_other -= computed[r]
                    if target[r] <= 1:
                        finish_s[r] = now
                        del admitted[r]
                    else:  # starts decoding with one token generated
                        decoding[r] = True
                        n_dec += 1
                        start_clock[r], generated_at_start[r] = clock, 1
                        decode_base += prompt[r] + 1 - clock
                        heapq.heappush(heap, (clock + target[r] - 1, r, epoch[r]))
        # -- requests whose last token came in this step or jump
        while heap and heap[0][0] <= clock:
            _, r, entry_epoch = heapq.heappop(heap)
            if entry_epoch != epoch[r]:
                continue
            decoding[r] = False
            n_dec -= 1
            decode_base -= prompt[r] + generated_at_start[r] - start_clock[r]
            finish_s[r] = now
            del admitted[r]
        # -- KV overflow: preempt the newest running requests, to be recomputed later
        while decode_base + n_dec * clock + kv_other + len(admitted) * half_block > capacity and len(admitted) > 1:
            victim = next(reversed(admitted))
            del admitted[victim]
            preemptions += 1
            if decoding[victim]:
                generated = generated_at_start[victim] + clock - start_clock[victim]
                decoding[victim] = False
                n_dec -= 1
                decode_base -= prompt[victim] + generated_at_start[victim] - start_clock[victim]
                epoch[victim] += 1
                prompt[victim] += generated  # its prompt is now prompt + output so far
                target[victim] -= generated
            else:
                prefilling.remove(victim)
                kv_other -= computed[victim]
            left[victim] = prompt[victim]
            computed[victim] = 0
            waiting.appendleft(victim)
    return SimulationResult(now, np.array(finish_s), steps, preemptions, [TraceSegment(*segment) for segment in trace])


def simulate_replica(prompt_tokens: np.ndarray | list[int], output_tokens: npt.ArrayLike, limits: SchedulerLimits,
                     latency: StepLatencyModel, cached_tokens: npt.ArrayLike | None = None, ready_s: npt.ArrayLike | None = None, jump: bool = True) -> SimulationResult:
    """Simulate one replica serving the requests; arrays are per request.

    `jump=False` advances one step at a time: the slow reference the jumps must match.
    """
    count = len(prompt_tokens)
    cached = np.zeros(count, np.int64) if cached_tokens is None else cached_tokens
    ready = np.zeros(count) if ready_s is None else ready_s
    if count == 0:
        return SimulationResult(0.0, np.zeros(0), 0, 0, [])
    return _simulate(prompt_tokens, output_tokens, cached, ready, limits, latency, jump)
