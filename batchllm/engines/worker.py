"""Engine worker process: one engine replica, fed over queues.

Loop, three calls a turn: take new messages (blocking only when idle), step the
engine, send what finished. The worker dies with its driver (PR_SET_PDEATHSIG), so a
`kill -9` of the driver never leaves an orphaned engine holding memory and cores. Told to stop,
it sends what it still holds and ends at once (`_end`): the interpreter's own teardown of a
loaded vLLM took 3 s of every engine stop (a run's end, a stage's change of models).
"""

from __future__ import annotations

import ctypes
import multiprocessing.util
import os
import queue
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

from batchllm.engines.engine import Stepper, StepperFactory
from batchllm.engines.protocol import EngineConfig, StopWorker, SubmitRequests, WorkerFailed, WorkerResults

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the idle loop's parent check still ends the worker


def _redirect_output(log_path: str | None) -> None:
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


def worker_main(config: EngineConfig, inbox: Any, outbox: Any, stepper_factory: StepperFactory) -> None:
    """Entry point of the worker process (spawned). `inbox` and `outbox`: multiprocessing queues (queue.Queue in a Ray actor's thread)."""
    _die_with_parent()
    _redirect_output(config.log_path)
    parent = os.getppid()
    try:
        stepper = stepper_factory(config)
        outbox.put(stepper.ready)
        serve(stepper, inbox, outbox, parent_alive=lambda: os.getppid() == parent)
    except BaseException as error:  # report, then exit: the driver decides what to do
        print(traceback.format_exc(), flush=True)  # into the engine's log
        outbox.put(WorkerFailed.of(error, traceback.format_exc(limit=8)))
    _end(outbox)


def _end(outbox: Any) -> None:
    """Exit once everything put on the outbox is in the pipe and the log is flushed, skipping the
    interpreter's teardown (other exit handlers, module and object finalisation: 1.1 s and 2.3 s
    with vLLM loaded on a 2-core host). The OS frees the engine's memory; vLLM's own worker
    processes (tensor parallel) end when their parent does (their death pipe)."""
    outbox.close()
    outbox.join_thread()
    # what exit runs for multiprocessing (CPython's own handler): semaphores made here (tqdm's lock) unlinked, else its tracker warns
    multiprocessing.util._exit_function()  # type: ignore[attr-defined]  # private, not in typeshed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve(stepper: Stepper, inbox: Any, outbox: Any, parent_alive: Callable[[], bool]) -> None:
    while True:
        messages = _take_messages(inbox, block=not stepper.has_work(), parent_alive=parent_alive)
        for message in messages:
            if isinstance(message, StopWorker):
                return
            if isinstance(message, SubmitRequests):
                refused = [r for r in (stepper.add(req) for req in message.requests) if r is not None]
                if refused:
                    outbox.put(WorkerResults(tuple(refused)))
        if stepper.has_work():
            finished, record = stepper.step()
            outbox.put(WorkerResults(tuple(finished), (record,)))


def _take_messages(inbox: Any, *, block: bool, parent_alive: Callable[[], bool]) -> list:
    messages: list = []
    while block and not messages:
        try:
            messages.append(inbox.get(timeout=1.0))
        except queue.Empty:
            if not parent_alive():
                return [StopWorker()]
    while True:
        try:
            messages.append(inbox.get_nowait())
        except queue.Empty:
            return messages
