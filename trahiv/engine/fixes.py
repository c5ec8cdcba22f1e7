"""Fixes for hivemind 1.1.12, applied once when a trahiv module that runs the engine is imported.

Each fix is small, idempotent, and has a test in tests/test_engine.py:

1. SIGINT: `DecentralizedAverager.run_in_background` sets SIGINT to SIG_IGN in the *calling* process (so Ctrl+C no
   longer stops training) and fails outside the main thread. We ignore SIGINT only around the fork, so the children
   still ignore it (their parent shuts them down) while the training process keeps its handler.
2. Orphans: a peer killed by SIGKILL leaves its DHT process (with p2pd) and averager processes running. Every engine
   process now watches its parent and, when the parent is gone, kills its own children and exits.
3. numpy 2: decoding 8-bit tensors (`Uniform8Bit`, `Quantile8Bit`, `Blockwise`) calls `int()` on a 1-element array,
   which numpy 2 rejects, so every 8-bit round silently failed. The decoders are replaced by ones that also check the
   buffer's size against its header before reading (the buffer comes from another peer). A reducer's results, which
   hivemind encodes with the codec registered for the type its sender's message names, use trahiv's faster uniform
   8-bit encoder (`trahiv.compression.FastUniform8BitQuantization`, the same wire format).
4. Noise: a round in which no averaging group formed is logged by hivemind at ERROR with a traceback ("Averaging step
   failed: could not find a group"), every time, though nothing broke; trahiv counts and reports such rounds itself
   (`trahiv.engine.averagers.ReportingMixin`): the record is kept as one INFO line without the traceback.
5. Matchmaking keys: after each group, hivemind 1.1.12 shifts bucket bits into an averager's group bits (its scheme
   for swarms split into groups of `target_group_size`), even with no target size. trahiv keys matchmaking by the
   collaborative step in those bits (`trahiv.engine.averagers.EpochKeyedMatchmaking`): a retry after a failed round
   would look under another key than its peers'. Bits of trahiv's width are kept when no target size is set.
6. Join requests that time out: a follower asks each leader it finds at most once per declaration (hivemind's
   `PotentialLeaders.past_attempts`), also when the leader only answered late: its `request_timeout` (half of
   `matchmaking_time`, at most 3 s; 1 s in the tests) was a refusal for the whole round. On a busy machine a leader's
   first answer took 1.3 s once; the leader then assembled its group without that follower, which stepped alone after
   `averaging_timeout`. A leader that did not answer in time goes back to the queue and is asked again at once, for as
   long as its declaration stands (tested in tests/test_matchmaking.py). A leader that accepted this follower and then
   sent no group (its answer ended, or the group's message came after hivemind's wait for it: this follower's
   declared time + `request_timeout`), and one whose first answer did not come within `request_timeout` when the time
   it declared is over (it is not queued again then; a leader that accepts and assembles at once counts the follower
   in as that answer leaves), is asked again at once: if its group counted this follower in, it sends it (12).
7. Matchmaking lookups in a busy loop: while an averager looks for a group and knows no leader better than itself (the
   leader, or anyone before the others declared), hivemind's `PotentialLeaders` asks for a new DHT lookup of the
   group key as soon as the previous one returns, for the whole matchmaking window (up to `matchmaking_time`, 15 s by
   default): ~400 lookups a second on loopback (1,061 in 2.5 s in tests/test_dht_traffic.py), each answered by the
   other DHT nodes. In a 4-peer swarm that overlapped the parameter round that ends every `average_state_every`-th
   step (the peers that finished it first look for the next gradient group), and the DHT processes used 0.74 CPU-s in
   that round against 0.04 in a gradient round (benchmarks/averaging_round.py --engines swarm). Lookups of one
   averager's group key are now at least `MATCHMAKING_LOOKUP_PERIOD` apart: a follower finds a new leader that much
   later at most.
8. Requests from a process that has exited: a DHT or averager process that could not read one request (its reply
   pipe travels as a file descriptor fetched from the sender, gone if the sender has exited) slept 3 s, its whole
   shutdown grace period: every DHT was terminated by SIGTERM at its swarm's shutdown. Such a request is dropped.
9. Locks left held: an engine process killed while it held one of hivemind's process-wide locks (shared by every
   engine process forked from the same process) blocked every engine process started afterwards, for good. After a
   kill, a lock still taken after `SHARED_LOCK_WAIT` is replaced (tested in tests/test_engine.py).
10. A group that assembles as a member's search ends: hivemind's `look_for_group` gives up when the step's deadline
   passes, also while this averager is a follower already accepted by a leader that is assembling the group right
   then (or a leader with followers, about to assemble). The leader counts it in, sends it the group, and runs the
   all-reduce without its part; it reports no group (seen in `benchmarks/diloco.py`, about once in 120 syncs of 4
   peers on 2 busy cores: the others' round partial, 28.6% of the values unaveraged, the peer that gave up on its
   own). Such an averager now waits for that group: a leader with followers, or one whose join request still awaits
   its answer (its leader may have accepted it and assembled at once: a DiLoCo peer in clean-clone run BH, 2026-11-28,
   gave up its search while its group averaged for 10 s without its part), up to `request_timeout` more; one accepted
   by its leader, or whose request that leader accepted is under way (or the one asking that leader again after it,
   6), up to `GRACE_ACCEPTED_TIMEOUTS` x `request_timeout`: a follower whose leader assembled as its declared time ran
   out, the group's message arriving after hivemind's wait for it (a busy machine; the test holds it 1.5 s), found no
   group while the leader's round went on without its part (tests/test_matchmaking.py): the signature of the DiLoCo
   syncs that failed in clean-clone runs CK and EY (stops 47 and 60), whose logs did not say which way they came to
   it.
11. A groupmate's parts that arrive before this averager began the group's all-reduce: a reducer answers a part for a
   group it does not run yet with BAD_GROUP_ID, unless hivemind's one event says a group is about to register. The
   event is set whenever a group of this averager ends, so in background mode (`delay_grad_averaging`: step k's round
   ends while step k+1's group, found, awaits its trigger) a peer that triggered its round first was turned away by a
   groupmate still finishing its step: both rounds partial, the two peers apart from then on (2 peers, 0.05 s local
   steps beside a busy core: 5 of 8 runs, 3 of them hung at exit with the update in flight). A part for a group this
   averager found now waits until that group begins, or its step ends; a part for a group not found yet, while the
   search under way as it arrived lasts (the leader's answer may be on its way: hivemind's own case), without the
   event (tests/test_matchmaking.py, tests/test_swarm.py). A part refused (BAD_GROUP_ID here, PROTOCOL_VIOLATION at the
   auth gate) gets its answer: the handler waits for the sender's end before it returns (`until_the_sender_ends`).
12. A follower that stopped waiting for the answer with which its leader counted it in: a leader that accepts a
   follower and assembles at once (its group then holds every expected peer, or its target size) counts the follower
   in as the answer leaves, and on a busy machine the answer can reach the follower after its `request_timeout`, when
   it has closed its request. It asks again (6), and hivemind's leader, its group assembled, answers
   NOT_LOOKING_FOR_GROUP: the leader's round went on without the follower's part, and the follower's search ended at
   its deadline without a group (the signature of a DiLoCo sync in clean-clone run CK, 2026-11-28: "sent
   BAD_GROUP_ID" 0.05 s after the other's search ended). A leader now sends a member of a group it led that asks again
   (same key and schema) that group, while its round of it has not begun or has nothing from that member yet
   (tests/test_matchmaking.py); so does a follower of a group (15).
13. A cancelled step whose search goes on: `StepControl.cancel` tells the averager process (its cancel future) before
   it marks the step cancelled, and the averager, woken by that future, reads the step as not cancelled and awaits its
   search instead, until that search ends (the step's deadline: up to `averaging_timeout`). Meanwhile it held the
   search lock, so the next step's search could not begin: a peer that stopped waiting for a round the swarm had
   finished without it (`SwarmOptimizer._average_gradients_and_load_into_optimizer`) was kept out of the next one
   too (tests/test_ring.py's slowest peer in none of 3 rounds: stops 50 and 54). Searches cancelled in a row in one
   idle peer: 1 of 12 and 2 of 8 went on (the project's CI of stop 57: one still under way 10 s after its cancel).
   The step is now marked cancelled first (tests/test_engine.py).
14. Garbage collection in the engine processes: each DHT and averager process is forked from the trainer and inherits
   its whole heap (torch, transformers, hivemind, the model's Python objects). A full (generation 2) collection there
   walks all of it: 0.23-0.42 s in a gradient averager of `benchmarks/averaging_round.py`'s peers, to free about
   2,000 objects of its own, once in some ten rounds, as its round was to begin; the ring rounds it fell in began
   0.2-0.45 s apart instead of about 0.1 s (two rounds of each run, each peer's collection in one of them). Every
   engine process now moves what it inherited to the collector's permanent generation as it starts (`gc.freeze()`,
   in the guarded `run` of fix 2): its collections walk only its own objects, and no longer write to (and so copy)
   the memory pages it shares with the trainer (tests/test_engine.py).
15. A member counted into a group it never heard of: a group can hold a peer whose answer or group message was lost
   (12 and 6 cover the ways known; the DiLoCo syncs of clean-clone runs CK, EY and FH came to this end by a way their
   INFO logs did not show: in FH, one peer's round began 0.02 s after the other's search, which went on 6 s without a
   group, holding that round's part all along, 11). Its groupmates' parts reach it while it searches, for a group it
   does not know. Such a part now makes the search ask its sender next (`PotentialLeaders.pop_next_leader` wrapped:
   whatever the time the sender declared, once per group), and the sender, a member of that group (its leader or a
   follower), sends it the group (12): it joins the round that counted it in (tests/test_matchmaking.py).
16. Records validated again at every read: a DHT node validates each record of every answer it gets, and a
   dictionary value (the swarm's progress: one subkey per peer) is validated record by record, each an RSA signature
   check (its public key parsed from the subkey first) and a pydantic validation, again at every read and from every
   replica that answers it. At 16 peers on 127.0.0.1 that was more than half of a DHT process's CPU during training
   (a py-spy profile of benchmarks/swarm_cost.py: 377 of 715 samples under `DHTProtocol._validate_dictionary`), and it
   grows with the swarm: a read validates N records from each replica. hivemind's validators are functions of the
   record alone (key, subkey, value, expiration), so a record accepted once is accepted again: each node now keeps the
   last `VALID_RECORDS_KEPT` records it accepted (of at most `VALID_RECORD_MAX_BYTES` each) and does not check them
   again; adding a validator forgets them (it may reject what the others accepted). A record that fails, or a larger
   one, is checked every time, as before (tests/test_engine.py).
(The `client_mode` bug is fixed in `trahiv.engine.optimizer.SwarmOptimizer`, which passes the DHT's mode explicitly.)
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import logging
import os
import signal
import threading
import time
import typing
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch  # imported where used: this package's import stays cheap (the CLI checks its input first)

logger = logging.getLogger("trahiv.averaging")
join_logger = logging.getLogger("trahiv.averaging.join")  # join requests sent and answered (engine.trail)

HIVEMIND_VERSION = "1.1.12"
EPOCH_KEY_BITS = 16  # matchmaking keys carry the collaborative step modulo 2**EPOCH_KEY_BITS
MATCHMAKING_LOOKUP_PERIOD = 0.1  # seconds between the starts of two DHT lookups of one averager's group key (fix 7)
REFUSAL_DRAIN_S = 2.0  # seconds a refusing handler may read a sender's stream to its end and wait for its close
FOUND_GROUP_POLL = 0.1  # seconds between looks at a found group's step while a part for it waits (fix 11)
# a join request its leader accepted (and the one asking again after it, fix 6) keeps a search past its deadline up to
# this many request_timeouts (fix 10): the group message's wait, the second request's answer and its group message
GRACE_ACCEPTED_TIMEOUTS = 3
GROUPS_KEPT = 4  # the groups an averager was in last (led or followed) that a member asking again can be sent (12, 15)
# the group bits of the round whose averaging step runs in this context: its search looks under them alone, whatever
# the owner sets meanwhile (set by trahiv.engine.averagers.EpochKeyedMatchmaking; read by fix 10's look_for_group)
SEARCH_BITS: contextvars.ContextVar[str | None] = contextvars.ContextVar("trahiv_search_bits", default=None)
PARENT_POLL_SECONDS = 0.25
VALID_RECORDS_KEPT = 4096  # records a DHT node accepted and does not validate again (fix 16): ~1 KB each
VALID_RECORD_MAX_BYTES = 8192  # larger records are validated every time: what fix 16 keeps stays under 32 MB
_applied = False


def apply() -> None:
    """Apply every fix once; refuse an engine version the fixes were not written for."""
    global _applied
    if _applied:
        return
    import hivemind

    if hivemind.__version__ != HIVEMIND_VERSION:
        raise RuntimeError(f"trahiv needs hivemind=={HIVEMIND_VERSION}, found {hivemind.__version__}")
    _fix_sigint()
    _fix_orphans()
    _fix_quantization()
    _quiet_no_group()
    _keep_epoch_keys()
    _retry_late_leaders()
    _pace_matchmaking_lookups()
    _finish_groups_in_assembly()
    _wait_for_found_groups()
    _send_the_group_to_a_member_asking_again()
    _ask_senders_of_unknown_groups()
    _cancel_the_step_first()
    _remember_valid_records()
    _applied = True


def _replace(cls: Any, name: str, replacement: Any) -> None:
    """Patch `cls.name`, remembering hivemind's function as `__wrapped__` (trahiv.engine.internals checks its
    signature, not the patch's)."""
    current = cls.__dict__.get(name) or getattr(cls, name)
    replacement.__wrapped__ = getattr(current, "__wrapped__", current)
    setattr(cls, name, replacement)


# 1. SIGINT ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def children_ignore_sigint():
    """Processes forked inside this block ignore SIGINT; the caller's own handler is restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be changed from the main thread; children then inherit the current one
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _fix_sigint() -> None:
    from hivemind.averaging.averager import DecentralizedAverager

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        with children_ignore_sigint():
            self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    _replace(DecentralizedAverager, "run_in_background", run_in_background)


@contextlib.contextmanager
def interrupt_on_signals():
    """Ctrl+C and SIGTERM raise KeyboardInterrupt in the main thread, so `finally` blocks leave the swarm cleanly; an
    error another thread hands over with `interrupt_main` is raised there the same way."""
    global _handling
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        global _pending_interrupt
        _note_where_raised()
        if isinstance(_pending_interrupt, BaseException):  # interrupt_main's error: raised where the thread waits
            _delivered.set()
            raise _pending_interrupt
        _pending_interrupt = f"received {signal.Signals(signum).name}"
        raise KeyboardInterrupt(_pending_interrupt)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    _handling = True
    try:
        yield
    finally:
        _handling = False
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        clear_interrupt()


_pending_interrupt: str | BaseException | None = None
_handling = False  # the main thread runs under interrupt_on_signals
_changing = 0  # the `changing_state` blocks the main thread is in
_raised_mid_change = False  # an interrupt was raised in the main thread inside one (see `interrupted_mid_change`)
_delivered = threading.Event()  # the main thread raised interrupt_main's error
INTERRUPT_GRACE = 2.0  # seconds the main thread has to reach a step (and raise there) before a signal interrupts it


def interrupt_main(error: BaseException, grace: float = INTERRUPT_GRACE) -> bool:
    """From another thread: make the main thread raise `error`. It raises at its next optimizer step (a point between
    steps: `raise_if_interrupted`); if it has not within `grace` seconds (it waits for an answer that will not come),
    a signal interrupts it where it is, as Ctrl+C would (`interrupt_on_signals`). False, and nothing done, when the
    main thread does not run under `interrupt_on_signals`."""
    global _pending_interrupt
    if not _handling or _pending_interrupt is not None:  # (a Ctrl+C first: that one is the reason to stop)
        return False
    _delivered.clear()
    _pending_interrupt = error
    main = threading.main_thread().ident

    def interrupt_if_still_waiting() -> None:
        if not _delivered.wait(grace) and _handling and _pending_interrupt is error and main is not None:
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt_if_still_waiting, name="trahiv-interrupt", daemon=True).start()
    return True


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt of a Ctrl+C / SIGTERM received under `interrupt_on_signals` (or `interrupt_main`'s
    error), again: hivemind 1.1.12 catches BaseException around its averaging waits ("Averaging gradients failed with
    KeyboardInterrupt ... Proceeding with local gradients"), so a signal arriving there would otherwise be swallowed
    and training go on."""
    if _pending_interrupt is not None:
        _note_where_raised()
    if isinstance(_pending_interrupt, BaseException):
        _delivered.set()
        raise _pending_interrupt
    if _pending_interrupt is not None:
        raise KeyboardInterrupt(_pending_interrupt)


def clear_interrupt() -> None:
    global _pending_interrupt, _raised_mid_change
    _pending_interrupt = None
    _raised_mid_change = False


@contextlib.contextmanager
def changing_state() -> typing.Iterator[None]:
    """Marks main-thread code that changes the training state (weights, optimizer statistics, step) tensor by tensor,
    or waits for an update that does (hivemind's optimizer step runs in its averager's executor). An interrupt raised
    inside leaves that state torn: `interrupted_mid_change` then says so, and no checkpoint is saved from it."""
    global _changing
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _changing += 1
    try:
        yield
    finally:
        _changing -= 1


@contextlib.contextmanager
def state_whole() -> typing.Iterator[None]:
    """Inside a `changing_state` block, main-thread code that only waits (for the peers, for an average) while the
    training state is whole, as at the step before: an interrupt raised in it leaves the state whole."""
    global _changing
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held, _changing = _changing, 0
    try:
        yield
    finally:
        _changing = held


def _note_where_raised() -> None:
    global _raised_mid_change
    if threading.current_thread() is threading.main_thread():  # (sticky: a torn update stays torn once swallowed)
        _raised_mid_change = _raised_mid_change or _changing > 0


def interrupted_mid_change() -> bool:
    """The interrupt raised in the main thread (Ctrl+C, SIGTERM, `interrupt_main`'s error) came inside a
    `changing_state` block: the training state may be half updated."""
    return _raised_mid_change


# 2. Orphans --------------------------------------------------------------------------------------------------------


def kill_descendants(pid: int | None = None, sig: int = signal.SIGKILL) -> list[int]:
    """Send `sig` to every descendant of `pid` (default: this process); return their pids."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(sig)
    return [child.pid for child in children]


def kill_if_named(pid: int | None, name: str) -> None:
    """SIGKILL process `pid` if it still runs under `name` (a pid recorded earlier: not one the system reused)."""
    import psutil

    if pid is None:
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        process = psutil.Process(pid)
        if name in process.name():
            process.kill()


def kill_engine_processes(processes: Any) -> None:
    """SIGKILL the engine processes still alive, with their children (a DHT's p2pd), reap them, and free the locks
    they may have held (`free_locks_of_killed`): a swarm started later in this process must not block on them."""
    for process in processes:
        if process.is_alive():
            kill_descendants(process.pid)
            process.kill()
            process.join(1.0)
    free_locks_of_killed(processes)


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_SECONDS)
    kill_descendants()  # e.g. the DHT's p2pd daemon
    os._exit(1)


def start_parent_watchdog() -> None:
    """In an engine child process: exit (taking its own children along) as soon as the parent process is gone."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), name="trahiv-parent-watchdog", daemon=True).start()


def _guard_run(cls: Any) -> None:
    original = cls.run
    if getattr(original, "_trahiv_guarded", False):
        return

    def run(self) -> None:
        gc.freeze()  # fix 14: what this process inherited from the trainer is never collected here
        start_parent_watchdog()
        self._inner_pipe = RequestReceiver(self._inner_pipe)  # fix 8
        return original(self)

    run._trahiv_guarded = True  # type: ignore[attr-defined]
    _replace(cls, "run", run)


def _fix_orphans() -> None:
    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.dht import DHT

    _guard_run(DHT)
    _guard_run(DecentralizedAverager)
    DHT._trahiv_dropped = DecentralizedAverager._trahiv_dropped = _dropped  # type: ignore[attr-defined]  # fix 8


# 8. Requests from a process that has exited ------------------------------------------------------------------------


class RequestReceiver:
    """An engine process's request pipe whose `recv()` drops a request it cannot rebuild (logged at DEBUG).

    A request carries an MPFuture whose reply pipe travels as a file descriptor that the receiver fetches from the
    sending process when it reads the request. An averager process that sent a request to its DHT (its periodic
    "download my state" record) and then shut down left one that no process could rebuild; hivemind's DHT and averager
    loops log the error and sleep `wait_timeout` / `request_timeout` (3 s) before reading on, which is their whole
    shutdown grace period: every in-process swarm's DHT was terminated by SIGTERM at shutdown, 3 s later. A process
    killed that way can die holding a lock that every process forked from the same parent shares (fix 9). The pipe
    itself failing (closed, broken) still raises, as before."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)

    def recv(self) -> Any:
        from multiprocessing.reduction import ForkingPickler

        while True:
            request = self._connection.recv_bytes()  # errors of the pipe itself raise here
            try:
                return ForkingPickler.loads(request)
            except (OSError, EOFError) as e:  # the sender of a file descriptor in the request has exited
                logger.debug(f"Dropped a request whose sender has exited ({e!r})")
                if not self._connection.poll():
                    return "_trahiv_dropped", [], {}


async def _dropped(self: Any) -> None:
    """What an engine process runs for a request `RequestReceiver` dropped: nothing."""


# 9. Process-wide locks left held by a killed engine process ---------------------------------------------------------

SHARED_LOCK_WAIT = 2.0  # seconds a shared lock may stay taken, after a kill, before it counts as left held


def _shared_locks() -> list[tuple[Any, str]]:
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    return [(MPFuture, "_update_lock"), (MPFuture, "_initialization_lock"), (SharedBytes, "_lock"),
            (_AsyncContextWrapper, "EXECUTOR_LOCK")]  # fmt: skip


def free_locks_of_killed(processes: Any) -> list[str]:
    """After engine processes were killed (hivemind's own "terminating it the hard way" after its grace period, or
    `Swarm.shutdown` past its timeout): replace the process-wide locks that one of them left held; return their names.

    hivemind creates these locks (`multiprocessing.Lock`, class attributes) once, at import, and every engine process
    forked from this process shares them: an MPFuture's result goes back to its process under `MPFuture._update_lock`.
    A process killed holding one leaves it taken for good, and every engine process started afterwards from this
    process blocked on it: a DHT never reported ready, and a second swarm in the same process (a notebook's second
    `trainer.train()`, a test process) waited forever (a CI run: three in-process swarms of tests/test_engine.py, 300 s
    each). Engine processes forked after the replacement use the new locks."""
    import multiprocessing as mp

    if not any(process.exitcode is not None and process.exitcode < 0 for process in processes):
        return []
    replaced = []
    for owner, name in _shared_locks():
        lock = getattr(owner, name)
        if lock.acquire(timeout=SHARED_LOCK_WAIT):
            lock.release()
        else:
            setattr(owner, name, mp.Lock())
            replaced.append(f"{owner.__name__}.{name}")
    if replaced:
        logger.warning(f"An engine process was killed holding {', '.join(replaced)}: replaced, for the processes "
                       "started from here on")  # fmt: skip
    return replaced


# 3. numpy-2 8-bit decoding -----------------------------------------------------------------------------------------


def _header(buffer: bytes, count: int) -> list[int]:
    if len(buffer) < 8 * count:
        raise ValueError(f"compressed tensor too short for its header: {len(buffer)} bytes")
    values = np.frombuffer(buffer, count=count, dtype=np.int64)
    if (values < 0).any():
        raise ValueError(f"compressed tensor header has negative sizes: {values.tolist()}")
    return [int(v) for v in values]


def _expect(numel: int, size: tuple[int, ...], what: str) -> None:
    expected = int(np.prod(size, dtype=np.int64)) if size else 1
    if numel != expected:
        raise ValueError(f"{what}: payload holds {numel} values, header says shape {size}")


def _extract_quantized(self, serialized_tensor) -> torch.Tensor:
    import torch

    buffer, size = serialized_tensor.buffer, tuple(serialized_tensor.size)
    (codebook_size,) = _header(buffer, 1)
    codebook_bytes = codebook_size * np.dtype(self.codebook_dtype).itemsize
    if 8 + codebook_bytes > len(buffer):
        raise ValueError(f"codebook of {codebook_size} entries does not fit in {len(buffer)} bytes")
    codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
    quantized = np.frombuffer(buffer, offset=8 + codebook_bytes, dtype=self.indices_dtype)
    _expect(quantized.size, size, type(self).__name__)
    if quantized.size and int(quantized.max()) >= codebook_size:
        raise ValueError(f"quantized index {int(quantized.max())} outside a codebook of {codebook_size}")
    values = np.take(codebook, quantized).reshape(size)  # ~10x faster than torch indexing with int64 indices
    result = torch.from_numpy(values).to(dtype=getattr(torch, serialized_tensor.dtype))
    return result.requires_grad_(serialized_tensor.requires_grad)


def _extract_blockwise(self, serialized_tensor) -> torch.Tensor:
    import torch
    from bitsandbytes.functional import dequantize_blockwise
    from hivemind.compression import quantization

    buffer, size = serialized_tensor.buffer, tuple(serialized_tensor.size)
    absmax_size, codebook_size = _header(buffer, 2)
    itemsize = np.dtype(self.codebook_dtype).itemsize
    data_offset = 16 + (absmax_size + codebook_size) * itemsize
    if data_offset > len(buffer):
        raise ValueError(f"blockwise header ({absmax_size}, {codebook_size}) does not fit in {len(buffer)} bytes")
    absmax = np.frombuffer(buffer, offset=16, count=absmax_size, dtype=self.codebook_dtype)
    codebook = np.frombuffer(buffer, offset=16 + absmax.nbytes, count=codebook_size, dtype=self.codebook_dtype)
    quantized = np.frombuffer(buffer, offset=data_offset, dtype=self.indices_dtype)
    _expect(quantized.size, size, "BlockwiseQuantization")
    blocksize = quantization._BLOCKWISE_QUANTIZATION_BLOCKSIZE
    if absmax_size != -(-quantized.size // blocksize):
        raise ValueError(f"blockwise payload of {quantized.size} values needs {-(-quantized.size // blocksize)} scales")
    result = dequantize_blockwise(
        torch.from_numpy(quantized.copy()).reshape(size),  # copies: the received buffer is read-only
        absmax=torch.from_numpy(absmax.copy()),
        code=torch.from_numpy(codebook.copy()),
        blocksize=blocksize,
        nested=False,
    )
    return result.to(getattr(torch, serialized_tensor.dtype)).requires_grad_(serialized_tensor.requires_grad)


def _fix_quantization() -> None:
    from hivemind.compression import quantization, serialization

    from trahiv.compression import FastUniform8BitQuantization

    _replace(quantization.Quantization, "extract", _extract_quantized)
    _replace(quantization.BlockwiseQuantization, "extract", _extract_blockwise)
    # a reducer encodes what it returns in the codec its sender's message names, looked up here: trahiv's encoder
    # (same wire format) instead of hivemind's, which took 1.7-2.2x its time for a 524,288-value part
    # (benchmarks/codecs.py)
    serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = FastUniform8BitQuantization()


# 4. "could not find a group" -----------------------------------------------------------------------------------------


class NoGroupIsNotAnError(logging.Filter):
    """hivemind's `logger.exception(e)` for a round without a group becomes one INFO line without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and "could not find a group" in str(error):
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = f"No averaging group formed: {error}", ()
        return True


def _quiet_no_group() -> None:
    averager_logger = logging.getLogger("hivemind.averaging.averager")
    if not any(isinstance(f, NoGroupIsNotAnError) for f in averager_logger.filters):
        averager_logger.addFilter(NoGroupIsNotAnError())


# 5. Matchmaking keys ------------------------------------------------------------------------------------------------


def _keep_epoch_keys() -> None:
    from hivemind.averaging.key_manager import GroupKeyManager

    original = GroupKeyManager.update_key_on_group_assembled
    if getattr(original, "_trahiv_epoch_keys", False):
        return

    async def update_key_on_group_assembled(self, group_info) -> None:
        if self.target_group_size is None and len(self.group_bits) == EPOCH_KEY_BITS:
            return  # trahiv's step key: the same for every peer of the round, kept for its retries
        await original(self, group_info)

    update_key_on_group_assembled._trahiv_epoch_keys = True  # type: ignore[attr-defined]
    _replace(GroupKeyManager, "update_key_on_group_assembled", update_key_on_group_assembled)


# 6. Join requests that time out -------------------------------------------------------------------------------------


def _retry_late_leaders() -> None:
    import asyncio

    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.utils.timed_storage import get_dht_time

    original = Matchmaking._request_join_group
    if getattr(original, "_trahiv_retry_late_leaders", False):
        return

    async def _request_join_group(self, leader):  # type: ignore[no-untyped-def]
        began = time.monotonic()
        declared = [expiration for peer, expiration in self.potential_leaders.past_attempts if peer == leader]
        until = f", its declared time {max(declared) - get_dht_time():+.2f} s" if declared else ""
        join_logger.debug(f"asking {leader} to lead{until}")
        # (while its answer is awaited, fix 10 keeps the search open past its deadline: see _wait_for_assembly; and
        # while an accepted request, or the request asking again that follows it, is under way: `accepted`)
        answered = asyncio.get_running_loop().create_future()
        in_flight = self.__dict__.setdefault("_trahiv_join_requests", {})  # its future -> {"accepted": bool}
        in_flight[answered] = state = {"accepted": False}
        try:
            group, accepted = await _ask(self, leader, state)
            if group is None and self.is_looking_for_group and not self.assembled_group.done():
                # A leader that counted this averager in sends the group to a member asking again (fix 12): ask once
                # more, now, if it may have. (1) It accepted this averager, then no group came: its answer ended at
                # once without it (its stream closed after ACCEPTED: seen in benchmarks/averaging_round.py about once
                # in 50 rounds of 4 peers on 2 cores, the leader's group counting this averager in; the others' ring
                # then failed after 15 s), or the group's message did not arrive within hivemind's wait for it (this
                # averager's declared time + request_timeout: a leader that assembled as that time ran out, its
                # message late on a busy machine). (2) Its first answer did not come within request_timeout and the
                # time it declared is over: a leader that accepts and assembles at once (its group then holds every
                # expected peer) counts this averager in as the answer leaves, which a busy machine can delay past
                # request_timeout; while its declaration stands it goes back to the queue instead (below), and a
                # leader asked again after its time is over never was (tests/test_matchmaking.py)
                if accepted:
                    why = "accepted this averager, then no group came"
                elif time.monotonic() - began >= self.request_timeout and not _declared_until_later(self, leader):
                    why = f"did not answer within {self.request_timeout} s, and the time it declared is over"
                else:
                    why = ""
                if why:
                    logger.debug(f"Leader {leader} {why}: asking it again")
                    group, _ = await _ask(self, leader, state)
        finally:
            del in_flight[answered]
            answered.set_result(None)
        if group is None and time.monotonic() - began >= self.request_timeout:
            # no first answer within request_timeout (or a group that did not form after a long wait): not a refusal.
            # The leader goes back to the queue with the expiration it declared, to be asked again at once while that
            # declaration stands (an answer takes at least request_timeout to miss: no busy loop)
            leaders = self.potential_leaders
            for attempt in [attempt for attempt in leaders.past_attempts if attempt[0] == leader]:
                leaders.past_attempts.discard(attempt)
                if attempt[1] > get_dht_time():
                    leaders.leader_queue.store(leader, attempt[1], attempt[1])
                    logger.debug(f"Leader {leader} did not answer within {self.request_timeout} s: asking it again")
        return group

    def _declared_until_later(self, leader) -> bool:  # type: ignore[no-untyped-def]
        """Whether the time `leader` declared when this averager asked it is still to come."""
        now = get_dht_time()
        return any(peer == leader and expiration > now for peer, expiration in self.potential_leaders.past_attempts)

    async def _ask(self, leader, state):  # type: ignore[no-untyped-def]
        """hivemind's join request, and whether the leader accepted this averager meanwhile (hivemind sets
        `was_accepted_to_group` on ACCEPTED and clears it as the request ends: watched from a task of its own, which
        also marks `state` accepted as the answer arrives)."""
        accepted = asyncio.ensure_future(self.was_accepted_to_group.wait())
        accepted.add_done_callback(lambda done: done.cancelled() or state.update(accepted=True))
        try:
            group = await original(self, leader)
        finally:
            await asyncio.sleep(0)  # (a set() in the request's last step reaches the watcher first)
            was_accepted = accepted.done() and not accepted.cancelled()
            accepted.cancel()
        return group, was_accepted

    _request_join_group._trahiv_retry_late_leaders = True  # type: ignore[attr-defined]
    _replace(Matchmaking, "_request_join_group", _request_join_group)


# 7. Matchmaking lookups in a busy loop ------------------------------------------------------------------------------


def _pace_matchmaking_lookups() -> None:
    import asyncio

    from hivemind.averaging.key_manager import GroupKeyManager
    from hivemind.utils.timed_storage import get_dht_time

    original = GroupKeyManager.get_averagers
    if getattr(original, "_trahiv_paced", False):
        return

    async def get_averagers(self, group_key, only_active):  # type: ignore[no-untyped-def]
        wait = getattr(self, "_trahiv_next_lookup", 0.0) - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._trahiv_next_lookup = time.monotonic() + MATCHMAKING_LOOKUP_PERIOD
        found = await original(self, group_key, only_active)
        if logger.isEnabledFor(logging.DEBUG) and set(found) != getattr(self, "_trahiv_last_found", None):
            self._trahiv_last_found, now = set(found), get_dht_time()  # (told when it changed: engine.trail)
            listed = ", ".join(f"{peer} ({expiration - now:+.2f} s)" for peer, expiration in sorted(found)) or "nobody"
            logger.debug(f"lookup of {group_key}: {listed}")
        return found

    get_averagers._trahiv_paced = True  # type: ignore[attr-defined]
    _replace(GroupKeyManager, "get_averagers", get_averagers)


# 10. A group that assembles as a member's search ends ---------------------------------------------------------------


def _finish_groups_in_assembly() -> None:
    import asyncio

    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.utils.asyncio import cancel_and_wait

    if getattr(Matchmaking.look_for_group, "_trahiv_finish_groups", False):
        return

    # adapted from hivemind.averaging.matchmaking.Matchmaking.look_for_group (hivemind 1.1.12): `asyncio.wait` instead
    # of `asyncio.wait_for` (which cancels the group's future at the deadline), and the grace for a group in assembly;
    # also the key of the step's round (SEARCH_BITS) set once the search holds hivemind's lock
    async def look_for_group(self, step):  # type: ignore[no-untyped-def]
        if self.is_looking_for_group:
            logger.info(
                "Another look_for_group is already in progress. The current run will be scheduled after"
                " the existing group is either assembled or disbanded."
            )
        async with self.looking_for_group(step):
            pinned = SEARCH_BITS.get()  # (trahiv: the bits of this step's round, see EpochKeyedMatchmaking)
            if pinned is not None and pinned != self.group_key_manager.group_bits:
                self.group_key_manager.group_bits = pinned
            key, timeout = self.group_key_manager.current_key, step.get_timeout()
            logger.debug(f"looking for a group under {key}, for {timeout:.2f} s")
            request_leaders_task = asyncio.create_task(self._request_join_potential_leaders(step))
            try:
                done, _ = await asyncio.wait({self.assembled_group}, timeout=step.get_timeout())
                if not done:
                    done = await _wait_for_assembly(self)
                return self.assembled_group.result() if done else None

            except BaseException as e:
                if len(self.current_followers) > 0:
                    async with self.lock_request_join_group:
                        await self.leader_disband_group()
                if not self.assembled_group.done():
                    self.assembled_group.set_exception(e)
                raise

            finally:
                await cancel_and_wait(request_leaders_task)
                self.assembled_group.cancel()

                while len(self.current_followers) > 0:
                    await self.follower_was_discarded.wait()
                    self.follower_was_discarded.clear()
                # note: the code above ensures that we send all followers away before creating new future
                self.assembled_group = asyncio.Future()
                self.was_accepted_to_group.clear()

    async def _wait_for_assembly(self) -> bool:  # type: ignore[no-untyped-def]
        """After the step's deadline: whether the group assembled within the grace. The grace lasts while this averager
        leads followers, or awaits a leader's answer to its join request (the leader may have accepted it and assembled
        at once, the group then already counting it in): `request_timeout`. While this averager is accepted by a
        leader, or a join request the leader accepted is under way (the one asking that leader again when no group
        came, fix 6), up to `GRACE_ACCEPTED_TIMEOUTS` x `request_timeout`: that leader's group counts this averager in
        (it assembles at the latest when its declaration, which ends before this averager's, runs out)."""
        began = time.monotonic()
        grace_end, accepted_end = began + self.request_timeout, began + GRACE_ACCEPTED_TIMEOUTS * self.request_timeout
        logger.debug(f"{self} - the step's deadline passed: waiting for a group in assembly, if any")
        while not self.assembled_group.done():
            in_flight: dict[Any, dict[str, bool]] = getattr(self, "_trahiv_join_requests", {})
            if self.current_leader is None and not self.current_followers and not in_flight:
                return False  # nothing under way: no group can count this averager in
            accepted = self.current_leader is not None or any(state["accepted"] for state in in_flight.values())
            left = (accepted_end if accepted else grace_end) - time.monotonic()
            if left <= 0:
                return False
            await asyncio.wait({self.assembled_group, *in_flight}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        return True

    look_for_group._trahiv_finish_groups = True  # type: ignore[attr-defined]
    _replace(Matchmaking, "look_for_group", look_for_group)


# 11. A groupmate's parts that arrive before this averager began the group's all-reduce --------------------------------


def _wait_for_found_groups() -> None:
    import asyncio

    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import achain, anext, as_aiter

    if getattr(DecentralizedAverager.rpc_aggregate_part, "_trahiv_found_groups", False):
        return
    look, register = Matchmaking.look_for_group, DecentralizedAverager._register_allreduce_group  # (look: fix 10's)

    async def look_for_group(self, step):  # type: ignore[no-untyped-def]
        try:
            group = await look(self, step)
        finally:
            for name in ("_trahiv_senders", "_trahiv_unknown_groups"):  # (15: this search's, asked or not)
                self.potential_leaders.__dict__.pop(name, None)
        found = self.__dict__.setdefault("_trahiv_found_groups", {})  # group id -> (its step, begun)
        for group_id in [group_id for group_id, (control, _) in found.items() if control.done()]:
            del found[group_id]  # (a group whose step ended before it began)
        if group is not None:
            found[group.group_id] = (step, asyncio.Event())
        return group

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info):  # type: ignore[no-untyped-def]
        with register(self, group_info):
            _, begun = getattr(self._matchmaking, "_trahiv_found_groups", {}).pop(group_info.group_id, (None, None))
            if begun is not None:
                begun.set()
            yield

    # adapted from hivemind.averaging.averager.DecentralizedAverager.rpc_aggregate_part (hivemind 1.1.12): the wait for
    # a group not running yet is `_until_group_begins` instead of hivemind's `_pending_groups_registered` event
    async def rpc_aggregate_part(self, stream, context):  # type: ignore[no-untyped-def]
        request = await anext(stream)
        if request.group_id not in self._running_groups:
            await _until_group_begins(self, request.group_id, context.remote_id)
        future = self._running_groups.get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            await until_the_sender_ends(stream)  # (not in hivemind's: see there)
            return
        group = await future
        async for message in group.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    # hivemind finds an RPC's message types in its annotations (ServicerBase._collect_rpc_handlers): hivemind's own
    rpc_aggregate_part.__annotations__ = typing.get_type_hints(DecentralizedAverager.rpc_aggregate_part)
    rpc_aggregate_part._trahiv_found_groups = True  # type: ignore[attr-defined]
    _replace(Matchmaking, "look_for_group", look_for_group)
    _replace(DecentralizedAverager, "_register_allreduce_group", _register_allreduce_group)
    _replace(DecentralizedAverager, "rpc_aggregate_part", rpc_aggregate_part)


async def until_the_sender_ends(stream: Any) -> None:
    """Before a handler that answered a sender's stream returns: read what the sender still sends, up to its end of
    stream, then wait for the sender to close its end (which cancels the handler), at most REFUSAL_DRAIN_S in all.
    hivemind's P2P closes the handler's end of the stream as the handler returns, and p2pd could then drop the answer
    just written: the sender saw its stream end without an answer (StopAsyncIteration, or BrokenPipeError from its
    writer). Measured between two processes on loopback, a part for an unknown group answered at once, calls one after
    the other: 29 and 19 of 1,000 without an answer idle, 15 of 200 and 27 of 500 beside one busy core, 12 of 500 beside
    two; with this wait 0 of 1,000 twice idle, and 0 of 22,000 in the test's calls beside one or two busy cores (reading
    to the end of stream alone: 1 of about 17,000; tests/test_partial_rounds.py). The sender closing first is what
    trahiv's reducers already wait for after their last part (trahiv.engine.allreduce); trahiv's sender closes its end
    as it has read a refusal."""
    import asyncio

    with contextlib.suppress(Exception):
        async with asyncio.timeout(REFUSAL_DRAIN_S):
            async for _ in stream:
                pass
            await asyncio.Event().wait()  # until cancelled: the sender closed its end


async def until_the_receiver_closes() -> None:
    """After a handler's last message, for a receiver that closes its end once it has read it (trahiv's state
    downloader on the empty message that ends a state): wait for that close, which cancels the handler, at most
    REFUSAL_DRAIN_S. A handler that returns at once lets hivemind's P2P close the stream with its last messages
    possibly still on their way, which p2pd could then drop (`until_the_sender_ends`; state downloads cut short:
    trahiv.engine.averagers.VersionedSchema.rpc_download_state)."""
    import asyncio

    await asyncio.sleep(REFUSAL_DRAIN_S)


async def _until_group_begins(averager: Any, group_id: bytes, sender: Any = None) -> None:
    """Wait until this averager runs group `group_id`, while it may still: a group it found (its step awaits its
    trigger) until that step ends or its deadline passes; an unknown group while the search under way as the part
    arrived goes on (the leader's answer with the group may be on its way: hivemind's own case).

    PowerSGD's all-reduces carry the group's ID with the phase's name appended (`PowerSGDGradientAverager`: one
    all-reduce per phase, P and Q), and it registers them in its own `_register_allreduce_group` (which does not set
    `begun`: the loop below sees the registration within FOUND_GROUP_POLL). Looked up by that ID alone, a phase's
    part that arrived between its group being found and registered was answered BAD_GROUP_ID, and the round was
    partial (a test beside a busy core, 1 run of 7)."""
    import asyncio

    from hivemind.utils.timed_storage import get_dht_time

    matchmaking = averager._matchmaking
    search = matchmaking.step_control
    logged = False
    while group_id not in averager._running_groups:
        found: dict[bytes, tuple[Any, Any]] = getattr(matchmaking, "_trahiv_found_groups", {})
        entry = found.get(group_id) or next((e for found_id, e in found.items() if group_id.startswith(found_id)), None)
        if entry is not None:
            control, begun = entry
            if control.done() or get_dht_time() >= control.deadline:
                return
            waiting = begun.wait()
        elif search is not None and matchmaking.step_control is search:
            if sender is not None and not logged:
                _ask_the_sender(matchmaking, group_id, sender)  # (15: it may run a group that counted this one in)
            waiting = asyncio.sleep(FOUND_GROUP_POLL)
        else:
            return
        if not logged:
            logger.debug(f"{averager} - a part for group {group_id.hex()[:8]} before it began: waiting")
            logged = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(waiting, FOUND_GROUP_POLL)


# 12. A follower that stopped waiting for the answer with which its leader counted it in ------------------------------


def _send_the_group_to_a_member_asking_again() -> None:
    import math

    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.proto import averaging_pb2

    if getattr(DecentralizedAverager.rpc_join_group, "_trahiv_kept_groups", False):
        return
    assemble, join = Matchmaking.leader_assemble_group, DecentralizedAverager.rpc_join_group
    follow = Matchmaking.follower_assemble_group

    def keep(self, group, key) -> None:  # type: ignore[no-untyped-def]
        kept = self.__dict__.setdefault("_trahiv_kept_groups", {})  # group id -> (the group, the key it formed under)
        kept[group.group_id] = (group, key)
        while len(kept) > GROUPS_KEPT:
            del kept[next(iter(kept))]

    async def leader_assemble_group(self):  # type: ignore[no-untyped-def]
        key = self.group_key_manager.current_key
        group = await assemble(self)
        keep(self, group, key)
        return group

    async def follower_assemble_group(self, leader, msg):  # type: ignore[no-untyped-def]
        key = self.group_key_manager.current_key
        group = await follow(self, leader, msg)
        keep(self, group, key)  # (15: a member asked by a groupmate that never heard of the group sends it too)
        return group

    def waiting_for(averager: Any, group: Any, peer: Any) -> bool:
        """Whether this averager's round of `group` still runs (or awaits its trigger) and has nothing from `peer`."""
        assembled = averager._matchmaking.assembled_group
        if assembled.done() and not assembled.cancelled() and assembled.exception() is None:
            if assembled.result().group_id == group.group_id:
                return True  # assembled, its search not over yet (it waits for the followers' answers to end)
        if group.group_id in getattr(averager._matchmaking, "_trahiv_found_groups", {}):
            return True  # found, its all-reduce not begun
        future = averager._running_groups.get(group.group_id)
        if future is None or future.cancelled():
            return False  # its round is over
        if not future.done():
            return True  # registered, its all-reduce about to begin
        runner = future.result()
        if peer not in runner.sender_peer_ids:
            return True  # (a member that sends nothing: an auxiliary peer)
        index, reducer = list(runner.sender_peer_ids).index(peer), runner.tensor_part_reducer
        return reducer.num_parts_received[index] == 0 and reducer.sender_failed_after[index] == math.inf

    async def rpc_join_group(self, request, context):  # type: ignore[no-untyped-def]
        matchmaking, peer = self._matchmaking, context.remote_id
        kept = list(getattr(matchmaking, "_trahiv_kept_groups", {}).values())
        group = next(
            (
                group
                for group, key in reversed(kept)
                if peer in group.peer_ids
                and peer != matchmaking.peer_id
                and request.group_key == key
                and request.schema_hash == matchmaking.schema_hash
                and waiting_for(self, group, peer)
            ),
            None,
        )
        if group is None:
            async for message in join(self, request, context):
                join_logger.debug(f"{peer} asked to join: answered {averaging_pb2.MessageCode.Name(message.code)}")
                yield message
            return
        logger.debug(f"{self} - {peer} asks to join again; it is in group {group.group_id.hex()[:8]}: sending it")
        async with matchmaking.lock_request_join_group:  # (hivemind's handler holds it as it answers ACCEPTED)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
        yield averaging_pb2.MessageFromLeader(
            code=averaging_pb2.BEGIN_ALLREDUCE,
            group_id=group.group_id,
            ordered_peer_ids=[member.to_bytes() for member in group.peer_ids],
            gathered=group.gathered,
        )

    # hivemind finds an RPC's message types in its annotations (ServicerBase._collect_rpc_handlers): hivemind's own
    rpc_join_group.__annotations__ = typing.get_type_hints(DecentralizedAverager.rpc_join_group)
    rpc_join_group._trahiv_kept_groups = True  # type: ignore[attr-defined]
    _replace(Matchmaking, "leader_assemble_group", leader_assemble_group)
    _replace(Matchmaking, "follower_assemble_group", follower_assemble_group)
    _replace(DecentralizedAverager, "rpc_join_group", rpc_join_group)


# 15. A member counted into a group it never heard of -------------------------------------------------------------


def _ask_the_sender(matchmaking: Any, group_id: bytes, sender: Any) -> None:
    """A part for group `group_id`, unknown here, came from `sender` while this averager's search goes on: a group
    counted this averager in and runs without its part. Its search asks `sender` next (a member of that group sends it
    to a member asking, 12), once per group."""
    leaders = matchmaking.potential_leaders
    unknown = leaders.__dict__.setdefault("_trahiv_unknown_groups", set())  # (this search's: fix 11's look_for_group)
    if group_id in unknown or sender == matchmaking.peer_id:
        return
    unknown.add(group_id)
    leaders.__dict__.setdefault("_trahiv_senders", []).append(sender)  # to ask, in the order their parts came
    join_logger.debug(f"a part for group {group_id.hex()[:8]}, unknown here, came from {sender}: asking it next")
    came = leaders.__dict__.get("_trahiv_sender_came")
    if came is not None:
        came.set()


def _ask_senders_of_unknown_groups() -> None:
    import asyncio

    from hivemind.averaging.matchmaking import PotentialLeaders

    original = PotentialLeaders.pop_next_leader
    if getattr(original, "_trahiv_senders", False):
        return

    async def pop_next_leader(self):  # type: ignore[no-untyped-def]
        came = self.__dict__.setdefault("_trahiv_sender_came", asyncio.Event())
        while True:
            senders = self.__dict__.get("_trahiv_senders")
            if senders:
                return senders.pop(0)  # (not in hivemind's queue: asked whatever its declaration)
            came.clear()
            popping, waking = asyncio.ensure_future(original(self)), asyncio.ensure_future(came.wait())
            try:
                await asyncio.wait({popping, waking}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waking.cancel()
                if not popping.done():
                    popping.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await popping
            if popping.done() and not popping.cancelled():
                return popping.result()  # (a leader, or hivemind's TimeoutError)

    pop_next_leader._trahiv_senders = True  # type: ignore[attr-defined]
    _replace(PotentialLeaders, "pop_next_leader", pop_next_leader)


# 13. A cancelled step whose search goes on --------------------------------------------------------------------------


def _cancel_the_step_first() -> None:
    from hivemind.averaging.control import StepControl
    from hivemind.utils.mpfuture import MPFuture

    if getattr(StepControl.cancel, "_trahiv_step_first", False):
        return

    def cancel(self) -> bool:  # type: ignore[no-untyped-def]
        # adapted from hivemind.averaging.control.StepControl.cancel (hivemind 1.1.12): the same three acts, the
        # step's own first (the averager reads it as soon as the cancel future fires)
        cancelled = MPFuture.cancel(self)
        if self._trigger is not None:
            self._trigger.cancel()
        if self._cancel is not None:
            self._cancel.set_result(None)
        return cancelled

    cancel._trahiv_step_first = True  # type: ignore[attr-defined]
    _replace(StepControl, "cancel", cancel)


# 16. Records validated again at every read --------------------------------------------------------------------------


def _remember_valid_records() -> None:
    import collections

    from hivemind.dht.validation import CompositeValidator, DHTRecord

    if getattr(CompositeValidator.validate, "_trahiv_remembered", False):
        return
    hivemind_validate, hivemind_extend = CompositeValidator.validate, CompositeValidator.extend

    def validate(self, record: DHTRecord) -> bool:  # type: ignore[no-untyped-def]
        accepted = self.__dict__.get("_trahiv_accepted")
        if accepted is None:
            accepted = self._trahiv_accepted = collections.OrderedDict()
        if record in accepted:  # (the same key, subkey, value bytes and expiration: hivemind's answer was True)
            accepted.move_to_end(record)
            return True
        if not hivemind_validate(self, record):
            return False
        if len(record.key) + len(record.subkey or b"") + len(record.value) > VALID_RECORD_MAX_BYTES:
            return True  # (anyone may store large records under keys no validator protects: not kept)
        accepted[record] = None
        if len(accepted) > VALID_RECORDS_KEPT:
            accepted.popitem(last=False)
        return True

    def extend(self, validators: typing.Iterable[Any]) -> None:  # type: ignore[no-untyped-def]
        hivemind_extend(self, validators)
        self.__dict__.pop("_trahiv_accepted", None)  # a validator added may reject what the others accepted

    validate._trahiv_remembered = True  # type: ignore[attr-defined]
    _replace(CompositeValidator, "validate", validate)
    _replace(CompositeValidator, "extend", extend)
