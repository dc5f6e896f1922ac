"""The dispatcher (issue 31): calls in order, one at a time, off the producer's thread; a
loop it runs takes turns with the calls its steps queue, and never waits for them."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from discovery._dispatch import Dispatcher

from .helpers import wait_for


def test_calls_run_in_order_one_at_a_time_on_one_thread() -> None:
    dispatcher = Dispatcher("test-calls")
    seen: list[tuple[int, int]] = []
    running = threading.Lock()

    def call(n: int) -> None:
        assert running.acquire(blocking=False), "two calls at once"
        seen.append((n, threading.get_ident()))
        running.release()

    for n in range(200):
        dispatcher.submit(call, n)
    dispatcher.stop()  # runs what is queued first
    assert [n for n, _ in seen] == list(range(200))
    assert len({thread for _, thread in seen}) == 1
    assert threading.get_ident() not in {thread for _, thread in seen}
    dispatcher.submit(call, 200)  # dropped once stopped
    assert len(seen) == 200


def test_a_failing_call_is_counted_and_the_next_runs() -> None:
    dispatcher = Dispatcher("test-failing")
    seen: list[int] = []
    dispatcher.submit(lambda: 1 / 0)
    dispatcher.submit(seen.append, 1)
    dispatcher.stop()
    assert seen == [1] and dispatcher.failures == 1


class Loop:
    """A loop whose every step queues one call; records which thread ran each step."""

    def __init__(self, dispatcher: Dispatcher, steps: int) -> None:
        self.dispatcher = dispatcher
        self.steps = steps
        self.step_threads: list[int] = []
        self.calls: list[tuple[int, int]] = []  # (step, thread)
        self.step_running_during_call: list[bool] = []
        self.in_step = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __iter__(self) -> Iterator[None]:
        for n in range(self.steps):
            self.in_step.set()
            self.step_threads.append(threading.get_ident())
            self.dispatcher.submit(self.call, n)
            self.in_step.clear()
            yield

    def call(self, n: int) -> None:
        self.calls.append((n, threading.get_ident()))
        assert not self.dispatcher.leading()  # never on the thread running the loop
        self.release.wait(10)


def test_a_loop_and_its_calls_take_turns_on_two_threads() -> None:
    dispatcher = Dispatcher("test-loop")
    loop = Loop(dispatcher, 300)
    # The first call holds its thread until the loop has moved on: otherwise, on a loaded
    # machine, that thread may finish each call and take the loop back before the other wakes.
    loop.release.clear()
    dispatcher.drive(iter(loop), "test-loop")
    wait_for(lambda: len(loop.step_threads) >= 2, message="a step while the first call runs")
    loop.release.set()
    wait_for(lambda: len(loop.calls) == 300, message="every call")
    dispatcher.stop()
    assert [n for n, _ in loop.calls] == list(range(300)) and dispatcher.failures == 0
    threads = set(loop.step_threads) | {thread for _, thread in loop.calls}
    assert len(threads) == 2  # the loop changes hands: a call runs where a step queued it


def test_a_slow_call_never_stalls_the_loop() -> None:
    dispatcher = Dispatcher("test-slow")
    loop = Loop(dispatcher, 50)
    loop.release.clear()  # the first call blocks
    dispatcher.drive(iter(loop), "test-slow")
    wait_for(lambda: len(loop.step_threads) == 50, message="every step, the first call blocked")
    assert [n for n, _ in loop.calls] == [0]
    assert loop.calls[0][1] not in loop.step_threads[1:]  # the other thread ran them
    loop.release.set()
    wait_for(lambda: len(loop.calls) == 50, message="the calls after the slow one")
    dispatcher.stop()
    assert [n for n, _ in loop.calls] == list(range(50)) and dispatcher.failures == 0


def test_a_call_from_outside_runs_while_the_loop_waits_in_a_step() -> None:
    dispatcher = Dispatcher("test-outside")
    waiting, go = threading.Event(), threading.Event()

    def loop() -> Iterator[None]:
        waiting.set()
        go.wait(10)  # a stream with nothing to say
        yield

    dispatcher.drive(loop(), "test-outside")
    assert waiting.wait(10)
    ran = threading.Event()
    dispatcher.submit(ran.set)
    assert ran.wait(10)  # not held back until the step ends
    go.set()
    dispatcher.stop()
