"""A round's matchmaking trail: what an averager's search did, kept in memory and logged when the round goes wrong.

A search that found no group, or a round that went on without a peer's part, is the end of a story told at DEBUG:
who this averager asked to lead and what each answered, who asked it and what it answered, the key it looked under,
which leaders its DHT lookups found, when a group assembled. At INFO (a user's run, a CI run) none of that is kept,
and a timing race seen once leaves only its end: two DiLoCo peers, one whose round went on without the other's part
("sent BAD_GROUP_ID") while the other found no group, in clean-clone runs CK, EY and FH (stops 47, 60, 61).

Each averager process records those DEBUG lines (hivemind's matchmaking, `trahiv.averaging` and its `join` child)
into a bounded buffer whatever the log level; lines at the level the loggers showed before still go where they went
(and are not kept: the log has them).
When a round ends partial, or a search in which this averager asked or was asked ends without a group, the lines of
that step are logged at INFO as one message (`MatchmakingTrail.tell`), times relative to the step's start.
"""

from __future__ import annotations

import collections
import logging
import os
import re

TRAIL_LOGGERS = ("hivemind.averaging.matchmaking", "trahiv.averaging")
JOIN_LOGGER = "trahiv.averaging.join"  # join requests sent and answered (engine.fixes)
# the loggers whose lines mean this averager asked or was asked: a search with none of them is a lone peer's
INTERACTION_LOGGERS = ("hivemind.averaging.matchmaking", JOIN_LOGGER)
TRAIL_KEPT = 400  # lines kept per averager process (a step of a busy search: a few dozen)
TRAIL_TOLD = 60  # lines told per round at most (its last ones)
_MATCHMAKING_REPR = re.compile(r"Matchmaking\(peer_id=.*?client_mode=(?:True|False)\)")

logger = logging.getLogger("trahiv.averaging")


class _Forward(logging.Handler):
    """Passes a logger's records at `level` or above on to its parent's handlers: what propagation did before the
    logger was opened to DEBUG for the trail."""

    def __init__(self, source: logging.Logger, level: int):
        super().__init__(level)
        self.source = source

    def emit(self, record: logging.LogRecord) -> None:
        parent = self.source.parent
        if parent is not None:
            parent.handle(record)


class MatchmakingTrail(logging.Handler):
    """The last TRAIL_KEPT matchmaking lines of this process: (time, logger name, message)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=TRAIL_KEPT)
        self.pid = os.getpid()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.INFO or getattr(record, "trail", False):
            return  # (shown in the log as it came; a trail told)
        try:
            message = record.getMessage()
        except Exception as e:  # (a malformed record: kept as what it is)
            message = f"{record.msg!r} ({e!r})"
        if record.exc_info and record.exc_info[1] is not None:
            message += f" ({record.exc_info[1]!r})"
        self.lines.append((record.created, record.name, _MATCHMAKING_REPR.sub("Matchmaking", message)))

    def since(self, began: float) -> list[tuple[float, str, str]]:
        return [line for line in self.lines if line[0] >= began]

    def tell(self, began: float, what: str, only_if_asked: bool = False) -> bool:
        """Log at INFO this process's lines since `began` (time.time()), headed by `what`; with `only_if_asked`, only
        if this averager asked or was asked meanwhile. Returns whether it logged."""
        lines = self.since(began)
        if not lines or (only_if_asked and not any(name in INTERACTION_LOGGERS for _, name, _ in lines)):
            return False
        shown = lines[-TRAIL_TOLD:]
        count = f"{len(lines)} lines" + (f", the last {len(shown)}" if len(shown) < len(lines) else "")
        body = "\n".join(f"  +{at - began:7.3f} s [{name.rsplit('.', 1)[-1]}] {message}" for at, name, message in shown)
        head = f"Matchmaking trail of {what} ({count}"
        logger.info(f"{head}):\n{body}", extra={"trail": True})
        return True


_trail: MatchmakingTrail | None = None


def matchmaking_trail() -> MatchmakingTrail:
    """This process's trail, installed on first use (in an averager process: its loggers are its own)."""
    global _trail
    if _trail is not None and _trail.pid == os.getpid():
        return _trail
    trail = MatchmakingTrail()
    for name in TRAIL_LOGGERS:
        source = logging.getLogger(name)
        for inherited in [h for h in source.handlers if isinstance(h, MatchmakingTrail)]:
            source.removeHandler(inherited)  # (the trail of the process this one was forked from)
        shown = source.getEffectiveLevel()
        if shown > logging.DEBUG:
            if source.handlers:
                continue  # set up by the application: left as it is (its own handlers would show DEBUG lines)
            if source.propagate:
                source.addHandler(_Forward(source, shown))
                source.propagate = False
            source.setLevel(logging.DEBUG)
        source.addHandler(trail)
    _trail = trail
    return trail
