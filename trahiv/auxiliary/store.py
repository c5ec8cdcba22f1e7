"""The auxiliary peer's embedded history of a run: one row per collaborative step, one per contributor, and run
metadata (run_id, max_steps, target_batch_size...).

`MetricsStore(url)` takes an SQLAlchemy URL: `sqlite:///<dir>/metrics.sqlite` by default (a file that keeps the
whole history across restarts), or a database server's URL. It is safe for one writer thread (the collector) and
any number of reader threads (the dashboard's web requests): every operation holds one lock and runs in its own
short transaction.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool

__all__ = ["MetricsStore", "default_store_url"]

STEP_KEYS = ("step", "time", "loss", "active_peers", "samples_per_second", "samples")
DILOCO_KEYS = ("peer_id", "outer_step", "inner_done", "inner_steps", "steps_per_second", "bytes_sent", "bytes_received",
               "last_seen")  # fmt: skip
CONTRIBUTOR_KEYS = ("peer_id", "name", "device", "samples", "seconds", "first_seen", "last_seen")

_metadata = sa.MetaData()
_steps = sa.Table(
    "steps",
    _metadata,
    sa.Column("step", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("time", sa.Float, nullable=False),  # unix time the step was recorded
    sa.Column("loss", sa.Float, nullable=True),  # None: no peer reported a loss for this step
    sa.Column("active_peers", sa.Integer, nullable=False),
    sa.Column("samples_per_second", sa.Float, nullable=False),
    sa.Column("samples", sa.Integer, nullable=False),
)
_contributors = sa.Table(
    "contributors",
    _metadata,
    sa.Column("peer_id", sa.String(128), primary_key=True),
    sa.Column("name", sa.String(64), nullable=True),
    sa.Column("device", sa.String(128), nullable=True),
    sa.Column("samples", sa.BigInteger, nullable=False),
    sa.Column("seconds", sa.Float, nullable=False),
    sa.Column("first_seen", sa.Float, nullable=False),
    sa.Column("last_seen", sa.Float, nullable=False),
    # what the peer's earlier sessions contributed (its counters restart with each process): for the collector
    sa.Column("base_samples", sa.BigInteger, nullable=False, default=0),
    sa.Column("base_seconds", sa.Float, nullable=False, default=0.0),
)
_diloco_peers = sa.Table(  # DiLoCo swarms (trahiv.auxiliary.diloco): each peer's latest progress record
    "diloco_peers",
    _metadata,
    sa.Column("peer_id", sa.String(128), primary_key=True),
    sa.Column("outer_step", sa.Integer, nullable=False),
    sa.Column("inner_done", sa.Integer, nullable=False),
    sa.Column("inner_steps", sa.Integer, nullable=False),
    sa.Column("steps_per_second", sa.Float, nullable=False),
    sa.Column("bytes_sent", sa.BigInteger, nullable=False),  # averaging_bytes_sent, cumulative, this peer's session
    sa.Column("bytes_received", sa.BigInteger, nullable=False),
    sa.Column("last_seen", sa.Float, nullable=False),
)
_meta = sa.Table(
    "meta",
    _metadata,
    sa.Column("key", sa.String(128), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)


def default_store_url(directory: str | Path) -> str:
    """The aux peer's default store: an SQLite file in `directory`."""
    return f"sqlite:///{Path(directory).expanduser().resolve() / 'metrics.sqlite'}"


class MetricsStore:
    """Steps, contributors and run metadata in an SQL database (SQLAlchemy Core)."""

    def __init__(self, url: str):
        try:
            parsed = make_url(url)
        except sa.exc.ArgumentError as e:
            raise ValueError(
                f"store: {url!r} is not a database URL (e.g. sqlite:///runs/metrics.sqlite): {e}"
            ) from None
        kwargs: dict[str, Any] = {}
        if parsed.get_backend_name() == "sqlite":
            if parsed.database in (None, "", ":memory:"):  # one shared in-memory database for every thread
                kwargs = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
            else:
                Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self.url = parsed.render_as_string(hide_password=True)
        self._lock = threading.RLock()
        self._engine = sa.create_engine(parsed, **kwargs)
        if parsed.get_backend_name() == "sqlite":
            sa.event.listen(self._engine, "connect", _sqlite_pragmas)
        with self._lock:
            _metadata.create_all(self._engine)

    # --- writing (the collector) ----------------------------------------------------------------------------

    def add_step(
        self, step: int, time: float, loss: float, active_peers: int, samples_per_second: float, samples: int
    ) -> None:
        """Record a collaborative step; re-adding a step replaces it."""
        row = {
            "step": int(step),
            "time": float(time),
            "loss": _finite_or_none(loss),
            "active_peers": int(active_peers),
            "samples_per_second": float(samples_per_second),
            "samples": int(samples),
        }
        with self._lock, self._engine.begin() as conn:
            conn.execute(sa.delete(_steps).where(_steps.c.step == row["step"]))
            conn.execute(sa.insert(_steps).values(**row))

    def upsert_contributor(
        self,
        peer_id: str,
        name: str | None,
        device: str | None,
        samples: int,
        seconds: float,
        last_seen: float,
        *,
        base_samples: int = 0,
        base_seconds: float = 0.0,
    ) -> None:
        """Create or update a contributor; `first_seen` is set on creation and kept afterwards. `samples` and
        `seconds` are totals; `base_*` is the part of them from the peer's earlier sessions (see `sessions()`)."""
        values = {"name": name, "device": device, "samples": int(samples), "seconds": float(seconds)}
        values.update(last_seen=float(last_seen), base_samples=int(base_samples), base_seconds=float(base_seconds))
        with self._lock, self._engine.begin() as conn:
            updated = conn.execute(sa.update(_contributors).where(_contributors.c.peer_id == peer_id).values(**values))
            if updated.rowcount == 0:
                conn.execute(sa.insert(_contributors).values(peer_id=peer_id, first_seen=float(last_seen), **values))

    def upsert_diloco_peer(self, peer_id: str, **values: Any) -> None:
        """Create or replace a DiLoCo peer's row (its latest progress record; keys: DILOCO_KEYS)."""
        row = {key: values[key] for key in DILOCO_KEYS if key != "peer_id"}
        with self._lock, self._engine.begin() as conn:
            conn.execute(sa.delete(_diloco_peers).where(_diloco_peers.c.peer_id == peer_id))
            conn.execute(sa.insert(_diloco_peers).values(peer_id=peer_id, **row))

    def diloco_peers(self) -> list[dict]:
        """DiLoCo peers, highest outer step first."""
        c = _diloco_peers.c
        query = sa.select(*(c[key] for key in DILOCO_KEYS)).order_by(c.outer_step.desc(), c.peer_id)
        with self._lock, self._engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query)]

    def set_meta(self, key: str, value: str) -> None:
        with self._lock, self._engine.begin() as conn:
            conn.execute(sa.delete(_meta).where(_meta.c.key == key))
            conn.execute(sa.insert(_meta).values(key=key, value=str(value)))

    # --- reading (the dashboard, the collector on restart) ---------------------------------------------------

    def steps(self, limit: int | None = None) -> list[dict]:
        """Steps in ascending order; with `limit`, only the last `limit` of them."""
        query = sa.select(*(_steps.c[key] for key in STEP_KEYS)).order_by(_steps.c.step.desc())
        if limit is not None:
            query = query.limit(max(int(limit), 0))
        with self._lock, self._engine.connect() as conn:
            rows = [dict(row._mapping) for row in conn.execute(query)]
        return rows[::-1]

    def contributors(self) -> list[dict]:
        """Contributors, most samples first."""
        query = sa.select(*(_contributors.c[key] for key in CONTRIBUTOR_KEYS)).order_by(
            _contributors.c.samples.desc(), _contributors.c.peer_id
        )
        with self._lock, self._engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query)]

    def sessions(self) -> dict[str, tuple[int, float, int, float]]:
        """peer_id -> (base_samples, base_seconds, samples, seconds): lets a restarted collector continue totals."""
        c = _contributors.c
        query = sa.select(c.peer_id, c.base_samples, c.base_seconds, c.samples, c.seconds)
        with self._lock, self._engine.connect() as conn:
            return {
                row.peer_id: (row.base_samples, row.base_seconds, row.samples, row.seconds)
                for row in conn.execute(query)
            }

    def meta(self) -> dict[str, str]:
        with self._lock, self._engine.connect() as conn:
            return {row.key: row.value for row in conn.execute(sa.select(_meta.c.key, _meta.c.value))}

    def close(self) -> None:
        with self._lock:
            self._engine.dispose()

    def __enter__(self) -> MetricsStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsStore({self.url!r})"


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(float(value)) else float(value)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    """WAL lets readers run while the collector writes; wait for a lock instead of failing at once."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()
