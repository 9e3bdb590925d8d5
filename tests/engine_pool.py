"""The real-engine tests' engines, kept between tests and bounded: `EnginePool`.

A test's run asks engines of the pool as a run asks its engine factory; the pool starts one per
sharing key and keeps it when the run stops it, so the next test that wants the same engine
skips the 20-45 s start. Invariant: at most `keep` engines stay alive while nobody uses them;
starting another stops the least recently used idle one first. (Unbounded, every new engine
shape a test asked for stayed alive to the session's end, about 2.7 GB each: a CI host ran out
of memory for the KV cache of the suite's last engines.) An engine in use is never stopped."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class _Lent:
    """An engine as a run sees it: its calls go to the pooled engine; `stop` hands it back."""

    def __init__(self, pool: EnginePool, key: Any, engine: Any):
        self._pool, self._key, self._engine = pool, key, engine
        self.config, self.ready = engine.config, engine.ready
        self._returned = False

    drain_steps = property(lambda self: self._engine.drain_steps)
    submit = property(lambda self: self._engine.submit)
    poll = property(lambda self: self._engine.poll)
    in_flight_limit = property(lambda self: self._engine.in_flight_limit)
    note = property(lambda self: self._engine.note)

    def stop(self) -> None:
        if not self._returned:
            self._returned = True
            self._pool.give_back(self._key)


class EnginePool:
    def __init__(self, start: Callable[[Any], Any], keep: int = 2):
        self._start, self.keep = start, keep
        self._engines: OrderedDict[Any, Any] = OrderedDict()  # least recently lent first
        self._users: dict[Any, int] = {}

    def __call__(self, config: Any) -> _Lent:
        key = config.sharing_key()
        if key not in self._engines:
            self._stop_idle(leaving=self.keep - 1)
            self._engines[key] = self._start(config)
            self._users[key] = 0
        self._engines.move_to_end(key)
        self._users[key] += 1
        return _Lent(self, key, self._engines[key])

    def give_back(self, key: Any) -> None:
        self._users[key] -= 1

    @property
    def alive(self) -> int:
        return len(self._engines)

    def _stop_idle(self, leaving: int) -> None:
        """Stop idle engines, least recently lent first, until `leaving` idle ones are left."""
        idle = [key for key in self._engines if self._users[key] == 0]
        for key in idle[:max(len(idle) - max(leaving, 0), 0)]:
            self._engines.pop(key).stop()
            del self._users[key]

    def close(self) -> None:
        """Stop every engine (at the session's end), each waited for in a thread of its own."""
        engines = list(self._engines.values())
        self._engines.clear()
        self._users.clear()
        with ThreadPoolExecutor(max_workers=max(1, len(engines))) as stopping:
            list(stopping.map(lambda engine: engine.stop(), engines))
