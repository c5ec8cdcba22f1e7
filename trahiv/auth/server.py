"""The auth server: moderators, allowlists, bans, access tokens and contributions of collaborative runs.

Moderators (bearer: the admin token created at first start) create an experiment (`run_id`) and its RSA signing key,
add users to its allowlist (each user gets a personal token, shown once, stored hashed), ban and unban them, and
read each user's contribution. A peer trades its user token and its RSA public key for a short-lived access token
(`trahiv.auth.tokens`), and reports its contribution at the same time. Everything is stored through SQLAlchemy
(SQLite by default): allowlists and bans survive restarts.

    POST /api/experiments                          admin  {run_id, token_lifetime}     experiment + its public key
    GET  /api/experiments                          admin                               experiments
    GET  /api/experiments/{run_id}                 public                              public key, token lifetime
    POST /api/experiments/{run_id}/users           admin  {username}                   username + user token
    GET  /api/experiments/{run_id}/users           admin                               allowlist, bans, contributions
    POST /api/experiments/{run_id}/users/{u}/ban   admin  {reason}
    POST /api/experiments/{run_id}/users/{u}/unban admin
    POST /api/experiments/{run_id}/users/{u}/token admin                               new user token (old revoked)
    POST /api/experiments/{run_id}/access_token    user   {public_key, contribution?}  signed access token
    GET  /api/experiments/{run_id}/contributions   public                              samples, steps per username
    POST /api/experiments/{run_id}/revert          admin  {step, source?, parameters_sha256?, reason?}  signed order
    GET  /api/experiments/{run_id}/revert          public                              the newest revert order or null

Malformed requests answer 422 naming the field; a missing or wrong token 401; a banned user or a non-admin 403;
an unknown experiment or user 404; a duplicate 409.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import ForeignKey, LargeBinary, String, UniqueConstraint, create_engine, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from trahiv.auth import keys
from trahiv.auth.revert import PEER_ID_PATTERN, SHA256_PATTERN, RevertOrder, SignedRevertOrder, sign_order

__all__ = ["AuthServerState", "create_app", "open_database"]

NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"
RUN_ID_PATTERN = r"^[A-Za-z0-9_.\-]{1,128}$"


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _now() -> float:
    return time.time()


# --- the database ---------------------------------------------------------------------------------------------------


class Base(DeclarativeBase):
    pass


class Admin(Base):
    __tablename__ = "admins"
    id: Mapped[int] = mapped_column(primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(default=_now)


class Experiment(Base):
    __tablename__ = "experiments"
    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    private_key: Mapped[bytes] = mapped_column(LargeBinary)  # DER; the database must stay private
    public_key: Mapped[str] = mapped_column(String(1024))  # OpenSSH
    token_lifetime: Mapped[float]
    created_at: Mapped[float] = mapped_column(default=_now)


class User(Base):
    __tablename__ = "users"
    __table_args__ = (UniqueConstraint("run_id", "username"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("experiments.run_id"))
    username: Mapped[str] = mapped_column(String(64))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    banned: Mapped[bool] = mapped_column(default=False)
    ban_reason: Mapped[str] = mapped_column(String(500), default="")
    created_at: Mapped[float] = mapped_column(default=_now)
    last_seen: Mapped[float | None] = mapped_column(default=None)


class Contribution(Base):
    """What one peer session of a user reported (cumulative): a user's contribution is the sum over sessions."""

    __tablename__ = "contributions"
    __table_args__ = (UniqueConstraint("user_id", "session"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    session: Mapped[str] = mapped_column(String(64))
    peer_key: Mapped[str] = mapped_column(String(64))  # sha256 of the peer's public key (hex, 32 characters)
    samples: Mapped[int] = mapped_column(default=0)
    steps: Mapped[int] = mapped_column(default=0)
    updated_at: Mapped[float] = mapped_column(default=_now)


class RevertRow(Base):
    """A revert order as signed (moderation log: every order of a run is kept)."""

    __tablename__ = "revert_orders"
    __table_args__ = (UniqueConstraint("run_id", "revert_id"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("experiments.run_id"))
    revert_id: Mapped[int]
    signed: Mapped[str] = mapped_column(String(8192))  # SignedRevertOrder JSON


def open_database(url: str) -> Engine:
    """Create the tables if needed; a SQLite file is created readable by its owner only (it holds signing keys)."""
    connect_args: dict[str, Any] = {}
    if url.startswith("sqlite"):
        connect_args["check_same_thread"] = False
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:" and not os.path.exists(path):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).touch(mode=0o600)
    engine = create_engine(url, connect_args=connect_args)
    Base.metadata.create_all(engine)
    return engine


class AuthServerState:
    """The database and the admin token bootstrap."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.sessions = sessionmaker(engine, expire_on_commit=False)

    def ensure_admin(self) -> str | None:
        """Create an admin token if none exists; return it (None if one already existed)."""
        with self.sessions.begin() as db:
            if db.scalar(select(func.count()).select_from(Admin)):
                return None
            token = "trahiv-admin-" + secrets.token_urlsafe(32)
            db.add(Admin(token_hash=_hash(token)))
            return token


# --- request and response bodies ------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class NewExperiment(_Body):
    run_id: str = Field(pattern=RUN_ID_PATTERN, description="the swarm's run_id")
    token_lifetime: float = Field(600.0, ge=5.0, le=7 * 86400.0, description="seconds an access token is valid")


class ExperimentOut(BaseModel):
    run_id: str
    public_key: str
    token_lifetime: float


class NewUser(_Body):
    username: str = Field(pattern=NAME_PATTERN, description="1-64 letters, digits, '_', '.', '-'")


class UserToken(BaseModel):
    run_id: str
    username: str
    token: str


class BanRequest(_Body):
    reason: str = Field("", max_length=500)


class UserOut(BaseModel):
    username: str
    banned: bool
    ban_reason: str
    samples: int
    steps: int
    peers: int
    last_seen: float | None


class ContributionReport(_Body):
    session: str = Field(pattern=r"^[A-Za-z0-9]{8,64}$", description="random id of one peer run")
    samples: int = Field(ge=0, le=2**62)
    steps: int = Field(ge=0, le=2**62)


class AccessTokenRequest(_Body):
    public_key: str = Field(min_length=16, max_length=2048, description="the peer's RSA public key, OpenSSH format")
    contribution: ContributionReport | None = None

    @field_validator("public_key")
    @classmethod
    def _rsa(cls, value: str) -> str:
        try:
            keys.load_public_key(value.encode())
        except keys.KeyError_ as e:
            raise ValueError(str(e)) from None
        return value


class RevertRequest(_Body):
    step: int = Field(ge=0, le=2**62, description="collaborative step of the checkpoint to return to")
    source: str = Field("", pattern=PEER_ID_PATTERN, description="peer ID serving the checkpoint ('' = any peer)")
    parameters_sha256: str = Field("", pattern=SHA256_PATTERN, description="SHA-256 of its trainable tensors")
    reason: str = Field("", max_length=500)


class AccessTokenOut(BaseModel):
    """The fields of hivemind's AccessToken protobuf; `signature` is the experiment key's (see trahiv.auth.keys)."""

    username: str
    public_key: str
    expiration_time: str
    expires_at: float
    signature: str
    experiment_public_key: str


# --- the app --------------------------------------------------------------------------------------------------------


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise HTTPException(401, "missing 'Authorization: Bearer <token>' header")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not re.fullmatch(r"[A-Za-z0-9_\-]{16,128}", token.strip()):
        raise HTTPException(401, "malformed Authorization header: expected 'Bearer <token>'")
    return token.strip()


def _validation_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    reasons = []
    for item in error.errors():
        where = ".".join(str(part) for part in item.get("loc", ()))
        reasons.append(f"{where}: {str(item.get('msg', '')).removeprefix('Value error, ')}")
    return JSONResponse({"detail": "; ".join(reasons) or "invalid request"}, status_code=422)


def _db(request: Request) -> Iterator[Session]:
    state: AuthServerState = request.app.state.auth
    with state.sessions.begin() as session:
        yield session


# scope="function": the session commits when the endpoint returns, before the answer is sent (FastAPI's default runs
# it after the answer: a client that asked again at once, e.g. to ban the user it had just added, got 404 under load)
DB = Annotated[Session, Depends(_db, scope="function")]
AuthHeader = Annotated[str | None, Header()]


def _admin(db: DB, authorization: AuthHeader = None) -> None:
    token = _bearer(authorization)
    if db.scalar(select(Admin).where(Admin.token_hash == _hash(token))) is None:
        raise HTTPException(403, "this token is not a moderator token")


Moderator = Depends(_admin)


def create_app(state: AuthServerState) -> FastAPI:
    app = FastAPI(title="trahiv auth server")
    app.state.auth = state
    app.add_exception_handler(RequestValidationError, _validation_error)

    def experiment(db: Session, run_id: str) -> Experiment:
        found = db.get(Experiment, run_id)
        if found is None:
            raise HTTPException(404, f"unknown experiment {run_id!r}")
        return found

    def user(db: Session, run_id: str, username: str) -> User:
        found = db.scalar(select(User).where(User.run_id == run_id, User.username == username))
        if found is None:
            raise HTTPException(404, f"user {username!r} is not on the allowlist of {run_id!r}")
        return found

    def describe(e: Experiment) -> ExperimentOut:
        return ExperimentOut(run_id=e.run_id, public_key=e.public_key, token_lifetime=e.token_lifetime)

    @app.post("/api/experiments", status_code=201, dependencies=[Moderator])
    def create_experiment(body: NewExperiment, db: DB) -> ExperimentOut:
        if db.get(Experiment, body.run_id) is not None:
            raise HTTPException(409, f"experiment {body.run_id!r} already exists")
        key = keys.generate_private_key()
        created = Experiment(
            run_id=body.run_id,
            private_key=keys.private_key_der(key),
            public_key=keys.public_key_openssh(key).decode(),
            token_lifetime=body.token_lifetime,
        )
        db.add(created)
        return describe(created)

    @app.get("/api/experiments", dependencies=[Moderator])
    def list_experiments(db: DB) -> list[ExperimentOut]:
        return [describe(e) for e in db.scalars(select(Experiment).order_by(Experiment.run_id))]

    @app.get("/api/experiments/{run_id}")
    def get_experiment(run_id: str, db: DB) -> ExperimentOut:
        return describe(experiment(db, run_id))

    @app.post("/api/experiments/{run_id}/users", status_code=201, dependencies=[Moderator])
    def add_user(run_id: str, body: NewUser, db: DB) -> UserToken:
        experiment(db, run_id)
        if db.scalar(select(User).where(User.run_id == run_id, User.username == body.username)) is not None:
            raise HTTPException(409, f"user {body.username!r} is already on the allowlist of {run_id!r}")
        token = "trahiv-user-" + secrets.token_urlsafe(32)
        db.add(User(run_id=run_id, username=body.username, token_hash=_hash(token)))
        return UserToken(run_id=run_id, username=body.username, token=token)

    @app.get("/api/experiments/{run_id}/users", dependencies=[Moderator])
    def list_users(run_id: str, db: DB) -> list[UserOut]:
        experiment(db, run_id)
        users = db.scalars(select(User).where(User.run_id == run_id).order_by(User.username))
        return [_user_out(db, u) for u in users]

    @app.post("/api/experiments/{run_id}/users/{username}/ban", dependencies=[Moderator])
    def ban(run_id: str, username: str, body: BanRequest, db: DB) -> UserOut:
        found = user(db, run_id, username)
        found.banned, found.ban_reason = True, body.reason
        return _user_out(db, found)

    @app.post("/api/experiments/{run_id}/users/{username}/unban", dependencies=[Moderator])
    def unban(run_id: str, username: str, db: DB) -> UserOut:
        found = user(db, run_id, username)
        found.banned, found.ban_reason = False, ""
        return _user_out(db, found)

    @app.post("/api/experiments/{run_id}/users/{username}/token", dependencies=[Moderator])
    def reissue(run_id: str, username: str, db: DB) -> UserToken:
        found = user(db, run_id, username)
        token = "trahiv-user-" + secrets.token_urlsafe(32)
        found.token_hash = _hash(token)
        return UserToken(run_id=run_id, username=username, token=token)

    @app.post("/api/experiments/{run_id}/access_token")
    def access_token(run_id: str, body: AccessTokenRequest, db: DB, authorization: AuthHeader = None) -> AccessTokenOut:
        token = _bearer(authorization)
        exp = experiment(db, run_id)
        found = db.scalar(select(User).where(User.run_id == run_id, User.token_hash == _hash(token)))
        if found is None:
            raise HTTPException(401, f"unknown user token for experiment {run_id!r} (not on its allowlist?)")
        if found.banned:
            reason = f": {found.ban_reason}" if found.ban_reason else ""
            raise HTTPException(403, f"user {found.username!r} is banned from {run_id!r}{reason}")
        now = _now()
        found.last_seen = now
        public_key = body.public_key.encode()
        expiration_time = keys.expiration_string(now + exp.token_lifetime)
        message = keys.token_message(found.username, public_key, expiration_time)
        signature = keys.sign(keys.load_private_key(exp.private_key), message)
        if body.contribution is not None:
            _record(db, found, hashlib.sha256(public_key).hexdigest()[:32], body.contribution)
        return AccessTokenOut(
            username=found.username,
            public_key=body.public_key,
            expiration_time=expiration_time,
            expires_at=datetime.fromisoformat(expiration_time).timestamp(),
            signature=signature.decode(),
            experiment_public_key=exp.public_key,
        )

    @app.get("/api/experiments/{run_id}/contributions")
    def contributions(run_id: str, db: DB) -> list[dict[str, Any]]:
        experiment(db, run_id)
        users = db.scalars(select(User).where(User.run_id == run_id))
        rows = [_user_out(db, u) for u in users]
        rows.sort(key=lambda r: (-r.samples, r.username))
        return [{"username": r.username, "samples": r.samples, "steps": r.steps, "peers": r.peers} for r in rows]

    @app.post("/api/experiments/{run_id}/revert", status_code=201, dependencies=[Moderator])
    def revert(run_id: str, body: RevertRequest, db: DB) -> SignedRevertOrder:
        private_key = keys.load_private_key(experiment(db, run_id).private_key)
        try:  # its own transaction: a racing second order fails on the unique key (409), not the whole request
            with state.sessions.begin() as tx:
                last = tx.scalar(select(func.max(RevertRow.revert_id)).where(RevertRow.run_id == run_id))
                order = RevertOrder(run_id=run_id, revert_id=int(last or 0) + 1, issued_at=_now(), **body.model_dump())
                signed = sign_order(private_key, order)
                tx.add(RevertRow(run_id=run_id, revert_id=order.revert_id, signed=signed.model_dump_json()))
        except IntegrityError:
            raise HTTPException(409, "another revert order was issued at the same moment: retry") from None
        return signed

    @app.get("/api/experiments/{run_id}/revert")
    def newest_revert(run_id: str, db: DB) -> dict[str, SignedRevertOrder | None]:
        experiment(db, run_id)
        row = db.scalar(select(RevertRow).where(RevertRow.run_id == run_id).order_by(RevertRow.revert_id.desc()))
        return {"revert": None if row is None else SignedRevertOrder.model_validate_json(row.signed)}

    return app


def _record(db: Session, user: User, peer_key: str, report: ContributionReport) -> None:
    row = db.scalar(select(Contribution).where(Contribution.user_id == user.id, Contribution.session == report.session))
    if row is None:
        row = Contribution(user_id=user.id, session=report.session, peer_key=peer_key, samples=0, steps=0)
        db.add(row)
    elif row.peer_key != peer_key:
        raise HTTPException(409, "this contribution session belongs to another peer")
    # cumulative per session: a delayed, older report never lowers it
    row.samples, row.steps = max(row.samples, report.samples), max(row.steps, report.steps)
    row.updated_at = _now()


def _user_out(db: Session, user: User) -> UserOut:
    samples, steps, peers = db.execute(
        select(
            func.coalesce(func.sum(Contribution.samples), 0),
            func.coalesce(func.max(Contribution.steps), 0),
            func.count(func.distinct(Contribution.peer_key)),
        ).where(Contribution.user_id == user.id)
    ).one()
    return UserOut(
        username=user.username,
        banned=user.banned,
        ban_reason=user.ban_reason,
        samples=int(samples),
        steps=int(steps),
        peers=int(peers),
        last_seen=user.last_seen,
    )
