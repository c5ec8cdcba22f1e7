"""Peer processes forked from a warm parent instead of started as fresh interpreters (tests only).

Each peer process of the swarm tests spent about 6.5 CPU-seconds importing torch, transformers' Trainer, peft (which
imports bitsandbytes and torch._dynamo) and datasets before it did anything: over a run's swarm tests, about half of
the test command's CPU time on 2 cores. Here multiprocessing's fork server imports those once per test
process (`PRELOAD`) and forks each peer from it: a peer then imports only hivemind, trahiv and the test worker (~1 s).

What a peer shares with its siblings is only what those third-party modules hold after import: no thread, socket or
lock. hivemind and trahiv are *not* preloaded: hivemind keeps process-wide multiprocessing locks in class attributes
(MPFuture, the asyncio context executor) that forked siblings would share, so that a peer SIGKILLed while holding one
would hang the others. Each peer imports them itself, as a separate interpreter would.

`spawn(...)` returns a `Forked` handle with the part of `subprocess.Popen`'s interface the tests use (pid, poll, wait,
returncode, send_signal, terminate, kill). Peers run inside other network namespaces (`ip netns exec`) keep using
subprocess; so do commands whose output a test reads from a pipe.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

__all__ = ["PRELOAD", "Forked", "spawn"]

PRELOAD = ["torch", "transformers", "transformers.trainer", "peft", "datasets", "scipy.optimize", "pydantic"]
_context: mp.context.ForkServerContext | None = None
_live: list[Forked] = []


def _fork_server() -> mp.context.ForkServerContext:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        atexit.register(_kill_leftovers)  # after multiprocessing's own exit hook is registered: runs before it
    return _context


class Forked:
    """A process forked from the fork server, seen through (part of) `subprocess.Popen`'s interface."""

    def __init__(self, process: mp.process.BaseProcess, args: list[str]) -> None:
        self._process, self.args = process, args
        self.pid: int = process.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(script: Path, argv: list[str], *, log: Path, cwd: Path, env: dict[str, str] | None = None) -> Forked:
    """Run `script`'s `main(*argv)` (a module in tests/, or a dotted module name) in a process forked from the fork
    server, stdout and stderr written to `log`, in `cwd`, with `env` added to the environment."""
    module = script.stem if isinstance(script, Path) else str(script)
    process = _fork_server().Process(
        target=_run, args=(module, list(argv), str(log), str(cwd), dict(env or {})), name=f"{module} {' '.join(argv)}"
    )
    Path(log).write_text("")  # there (and empty) once this returns, as with subprocess and open(log, "w")
    process.start()
    forked = Forked(process, [str(script), *argv])
    _live.append(forked)
    return forked


def _run(module: str, argv: list[str], log: str, cwd: str, env: dict[str, str]) -> None:
    """The forked child: what `python SCRIPT ARGV > LOG 2>&1` (cwd, env) would do, from a preloaded interpreter."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True, write_through=True)  # as PYTHONUNBUFFERED: tests read logs live
    os.chdir(cwd)
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read by torch at its import, which the fork server did before this was set
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    mp.set_start_method("fork", force=True)  # a fresh interpreter's default here (the child inherits "forkserver")
    _reseed()
    sys.argv = [module, *argv]
    code: int | str | None = 1
    try:
        code = importlib.import_module(module).main(*argv)
    except KeyboardInterrupt:
        code = 130
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # what the interpreter runs at exit (multiprocessing's bootstrap ends in os._exit)
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)  # multiprocessing's bootstrap turns it into the exit code (and runs the exit hooks it owns)


def _reseed() -> None:
    """Siblings forked from one server start with one RNG state: give each its own, as separate interpreters have."""
    import numpy as np
    import torch

    np.random.seed(int.from_bytes(os.urandom(4), "little"))
    torch.seed()


def _kill_leftovers() -> None:
    """At exit of the test process: SIGKILL the peers it forked that still run (a failed test's), then reap them;
    multiprocessing would otherwise wait for each of them at exit."""
    for forked in _live:
        if forked.poll() is None:
            forked.kill()
            forked._process.join(5)
