"""The real-engine tests' engine pool (tests/engine_pool.py), on fake engines."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.engine_pool import EnginePool


@dataclass(frozen=True)
class Config:
    name: str

    def sharing_key(self) -> str:
        return self.name


@dataclass
class FakeEngine:
    config: Config
    ready: bool = True
    stopped: bool = False
    submitted: list = field(default_factory=list)

    def submit(self, request):
        self.submitted.append(request)

    def stop(self):
        self.stopped = True


def make_pool(keep=2):
    started: list[FakeEngine] = []

    def start(config):
        started.append(FakeEngine(config))
        return started[-1]

    return EnginePool(start, keep=keep), started


def test_a_returned_engine_is_lent_again_without_a_start():
    pool, started = make_pool()
    pool(Config("a")).stop()
    lent = pool(Config("a"))
    lent.submit("r1")
    assert len(started) == 1 and started[0].submitted == ["r1"] and not started[0].stopped


def test_a_new_engine_stops_the_least_recently_lent_idle_one_beyond_the_bound():
    pool, started = make_pool(keep=2)
    for name in ("a", "b"):
        pool(Config(name)).stop()
    pool(Config("a")).stop()  # a lent again: b is now the least recent
    pool(Config("c")).stop()
    assert [(e.config.name, e.stopped) for e in started] == [("a", False), ("b", True), ("c", False)]
    assert pool.alive == 2


def test_engines_in_use_are_never_stopped_and_do_not_count_against_the_bound():
    pool, started = make_pool(keep=1)
    held = [pool(Config("a")), pool(Config("b"))]  # one run holding two engines
    pool(Config("c")).stop()
    assert not any(e.stopped for e in started) and pool.alive == 3
    for lent in held:
        lent.stop()
    pool(Config("d")).stop()  # a, b and c idle before it, keep 1: all three stopped to make room for d
    assert [e.config.name for e in started if not e.stopped] == ["d"]


def test_stopping_a_lent_engine_twice_gives_it_back_once():
    pool, started = make_pool(keep=1)
    first, second = pool(Config("a")), pool(Config("a"))
    first.stop()
    first.stop()
    pool(Config("b")).stop()  # a is still used by `second`: it stays
    assert not started[0].stopped
    second.stop()
    pool(Config("c"))
    assert started[0].stopped and started[1].stopped


def test_close_stops_every_engine():
    pool, started = make_pool()
    pool(Config("a"))
    pool(Config("b")).stop()
    pool.close()
    assert all(e.stopped for e in started) and pool.alive == 0
