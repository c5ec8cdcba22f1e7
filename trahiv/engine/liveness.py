"""A peer's engine processes, watched: the DHT process, its p2p daemon and the averagers.

A peer talks to the swarm only through them. When one of them ends while the peer still runs (killed by the kernel's
OOM killer, a crash, a stray `kill`), hivemind 1.1.12 never notices: every DHT read waits for an answer that will not
come, so the trainer hung in its next progress read, silently, for good; with p2pd gone the DHT answered from its
cache, and the peer went on training alone while the others waited for it in every round (averaging_timeout each).
`EngineWatch` waits on the processes' sentinels (and polls p2pd, the DHT process's child) and calls `on_lost` once with
a sentence that says which process ended and how; the peer's own shutdown closes the watch first. A trainer
(`trahiv.swarm.Swarm`) then stops with that sentence: at its next optimizer step, or, if it waits for an answer that
will not come, where it waits (`trahiv.engine.fixes.interrupt_main`). A request to the DHT awaited through `dht_answer`
ends once the DHT process is gone: in a thread other than the main one with DHTProcessEnded.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from trahiv.engine.fixes import INTERRUPT_GRACE, kill_engine_processes, kill_if_named, raise_if_interrupted

logger = logging.getLogger("trahiv.engine")

__all__ = ["DHT_ANSWER_POLL", "LIVENESS_PERIOD", "DHTProcessEnded", "EngineWatch", "describe_exit", "dht_answer"]

LIVENESS_PERIOD = 1.0  # seconds between looks at p2pd (the other processes wake the watch as they end)
P2PD_AFTER_DHT_S = 2.0  # seconds a DHT process whose p2pd ended has to be seen ending too (then the DHT is named)
DHT_ANSWER_POLL = 0.5  # seconds between looks at the DHT process while a request to it awaits its answer
DHT_GONE_GRACE = P2PD_AFTER_DHT_S + INTERRUPT_GRACE  # (main thread) seconds for the watch's error to come


def describe_exit(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code is None:
        return "ended"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the kernel's out-of-memory killer sends it, as does kill -9)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


def _p2pd_of(dht_pid: int) -> int | None:
    import psutil

    try:
        return next((c.pid for c in psutil.Process(dht_pid).children() if "p2pd" in c.name()), None)
    except psutil.NoSuchProcess:
        return None


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class DHTProcessEnded(RuntimeError):
    """A request to a DHT whose process has ended: its answer will never come."""


def dht_answer(dht: Any, future: Any, timeout: float | None = None) -> Any:
    """The answer to a request made to `dht` with `return_future=True` (`future.result(timeout)`), or an error once
    the DHT process is seen gone with the request unanswered. hivemind's DHT keeps both ends of its request pipe, so a
    request to a DHT process that has ended is sent without an error and its answer awaited for good: a DiLoCo sync
    running in the background waited so for the others' progress, and its peer, stopped by the engine watch, could not
    save its training state (the sync never ended). The error is DHTProcessEnded; in the main thread, the engine
    watch's (the peer's one message, `fixes.interrupt_main`) once it has come, also after a handler swallowed it."""
    main = threading.current_thread() is threading.main_thread()
    deadline = None if timeout is None else time.monotonic() + timeout
    gone_since: float | None = None
    while True:
        left = DHT_ANSWER_POLL if deadline is None else min(DHT_ANSWER_POLL, max(deadline - time.monotonic(), 0.0))
        try:
            return future.result(left)
        except TimeoutError:
            pid = getattr(dht, "pid", None)
            if pid is None or _gone(pid):
                gone_since = time.monotonic() if gone_since is None else gone_since
                if main:
                    raise_if_interrupted()
                # (the main thread of a watched peer gives the watch time to name the process that ended)
                if not main or time.monotonic() - gone_since >= DHT_GONE_GRACE:
                    raise DHTProcessEnded(f"the DHT process (pid {pid}) ended with a request unanswered") from None
            if deadline is not None and time.monotonic() >= deadline:
                raise


class EngineWatch:
    """Calls `on_lost(reason)` once if the DHT process, its p2p daemon or a process of `processes()` (re-read every
    LIVENESS_PERIOD: averagers start after the DHT) ends before `close()`."""

    def __init__(self, dht: Any, processes: Callable[[], Sequence[Any]], on_lost: Callable[[str], None]):
        self.dht, self.processes, self.on_lost = dht, processes, on_lost
        self.p2pd_pid = _p2pd_of(dht.pid) if dht.pid is not None else None
        self.lost: str | None = None
        self._stop_read, self._stop_write = os.pipe()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trahiv-engine-watch", daemon=True)

    def start(self) -> EngineWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching (before this peer shuts its engine down on purpose). After a loss of the DHT process or p2pd,
        what is left of the pair is killed: the p2pd that a killed DHT process left behind (no longer the peer's
        descendant, so not stopped with it), or the DHT process of a p2pd that ended (it cannot leave the swarm
        gracefully without it: hivemind waited out its 3 s grace period, then terminated it)."""
        if self._closed.is_set():
            return
        self._closed.set()
        os.write(self._stop_write, b"x")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(LIVENESS_PERIOD + 1.0)
        for fd in (self._stop_read, self._stop_write):
            os.close(fd)
        if self.lost is not None and (self.dht.exitcode is not None or self.p2pd_pid is None or _gone(self.p2pd_pid)):
            kill_engine_processes([self.dht])
            kill_if_named(self.p2pd_pid, "p2pd")

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as e:  # (a process object closed under the watch) the peer runs on, unwatched
            if not self._closed.is_set():
                logger.debug(f"Engine watch stopped: {e!r}")

    def _watch(self) -> None:
        while not self._closed.is_set():
            others = [p for p in self.processes() if p is not self.dht and getattr(p, "pid", None) is not None]
            watched = [self.dht, *others]
            wait([self._stop_read, *(p.sentinel for p in watched)], timeout=LIVENESS_PERIOD)
            if self._closed.is_set():
                return
            reason = self._check(watched)
            if reason is not None:
                self.lost = reason
                logger.debug(f"Engine watch: {reason}")
                self.on_lost(reason)
                return

    def _check(self, watched: Sequence[Any]) -> str | None:
        ended = wait([p.sentinel for p in watched], timeout=0)
        for process in watched:
            if process.sentinel in ended:
                # A sentinel is readable once the kernel has closed the process's files, a moment before the process
                # can be reaped: `exitcode` (waitpid without waiting) may still read None then; on a busy CPU the
                # watch looked in that moment and named a killed DHT process's p2pd instead (stop 45's CI run).
                # `join` blocks in waitpid until the process is reaped.
                process.join(P2PD_AFTER_DHT_S)
            code = process.exitcode
            if code is not None:
                what = "DHT process" if process is self.dht else f"{type(process).__name__} process"
                return f"its {what} (pid {process.pid}) {describe_exit(code)}"
        if self.p2pd_pid is not None and _gone(self.p2pd_pid):
            # a killed DHT process takes its p2pd along (p2pd exits with its parent) and may itself be reapable only
            # later: on a busy CPU its p2pd was found gone first, and the DHT process's death was reported as p2pd's
            self.dht.join(P2PD_AFTER_DHT_S)
            if self.dht.exitcode is not None:
                return f"its DHT process (pid {self.dht.pid}) {describe_exit(self.dht.exitcode)}"
            return f"its p2p daemon (p2pd, pid {self.p2pd_pid}) ended"
        return None
