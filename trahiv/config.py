"""The typed `hivemind_config`: what a peer needs to join a swarm, validated before anything starts.

`HivemindConfig.load(value)` accepts a dict, a JSON string or the path of a JSON/YAML file. Unknown keys fail with the
closest valid key; every value is type-checked; multiaddrs are parsed. Nothing here imports torch or starts a process.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

__all__ = [
    "COMPRESSIONS",
    "AggregationConfig",
    "AuthConfig",
    "DHTConfig",
    "DiLoCoConfig",
    "HivemindConfig",
    "MetricsConfig",
    "OptimizerConfig",
    "REDACTED",
    "TOKEN_ENV",
    "redact",
]

REDACTED = "<redacted>"  # what secrets read as wherever the arguments leave the process (str, to_dict, pickles)
SECRET_KEYS = frozenset({"token"})  # keys of `auth` whose values are secret
TOKEN_ENV = "TRAHIV_AUTH_TOKEN"  # the auth token, when hivemind_config.auth has neither token nor token_file

COMPRESSIONS = ("none", "fp16", "scaled_fp16", "uniform8bit", "quantile8bit", "blockwise8bit", "size_adaptive")
CompressionName = Literal[
    "none", "fp16", "scaled_fp16", "uniform8bit", "quantile8bit", "blockwise8bit", "size_adaptive"
]


def _check_maddr(value: str, *, need_peer_id: bool) -> str:
    from trahiv.engine.multiaddr import multiaddr_class  # hivemind's parser, without hivemind's (and torch's) import

    Multiaddr = multiaddr_class()
    try:
        maddr = Multiaddr(value)
    except Exception as e:  # the engine raises several parse error classes
        raise ValueError(f"malformed multiaddr {value!r}: {e}") from None
    if need_peer_id and "p2p" not in {p.name for p in maddr.protocols()}:
        raise ValueError(
            f"initial peer {value!r} has no /p2p/<peer id> part; copy the whole address the other peer printed "
            "after 'To join the training, use initial_peers = [...]'"
        )
    return value


class _Section(BaseModel):
    """Strict base: unknown keys fail naming the closest valid key."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            valid = list(cls.model_fields)
            for key in data:
                if key not in cls.model_fields:
                    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
                    hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}"
                    raise ValueError(f"unknown key {key!r}: {hint}")
        return data


class DHTConfig(_Section):
    """Keyword arguments for `hivemind.DHT`: how this peer finds the swarm and how others reach it."""

    initial_peers: list[str] = Field(default_factory=list, description="multiaddrs of running peers to join")
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"],
        description="addresses to listen on; /ip4/0.0.0.0/tcp/0 accepts peers from other machines",
    )
    announce_maddrs: list[str] | None = Field(None, description="public addresses to announce (explicit ports)")
    identity_path: str | None = Field(None, description="private key file that fixes this peer's ID")
    client_mode: bool | Literal["auto"] | None = Field(
        None,
        description="true: behind NAT, connects out and accepts no incoming connections; false: accepts them; "
        "'auto' or unset: client mode if an initial peer cannot dial this one back (trahiv.connectivity)",
    )
    use_relay: bool = Field(True, description="relay connections through other peers (libp2p circuit relay)")
    use_auto_relay: bool = Field(False, description="find relays automatically when behind NAT")
    nat_port_map: bool = Field(True, description="ask the gateway for a port mapping (UPnP/NAT-PMP)")
    startup_timeout: float = Field(30.0, gt=0, description="seconds to wait for the p2p daemon to start")
    bootstrap_timeout: float | None = Field(
        None, gt=0, description="seconds to wait for initial peers to answer (default: wait_timeout)"
    )
    wait_timeout: float = Field(3.0, gt=0, description="seconds to wait for one DHT RPC")
    num_workers: int = Field(4, ge=1, description="parallel DHT requests")
    bucket_size: int = Field(
        8,
        ge=2,
        le=64,
        description="Kademlia's k: peers per routing-table bucket and how many nearest peers a lookup asks (8, as "
        "BitTorrent's DHT; hivemind's default 20 made every lookup ask every peer of a swarm of up to ~20)",
    )
    quic: bool | None = Field(None, description="also use QUIC (UDP) transport")
    tls: bool = Field(True, description="encrypt connections with TLS")

    @field_validator("initial_peers")
    @classmethod
    def _peers(cls, value: list[str]) -> list[str]:
        return [_check_maddr(v, need_peer_id=True) for v in value]

    @field_validator("host_maddrs", "announce_maddrs")
    @classmethod
    def _maddrs(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else [_check_maddr(v, need_peer_id=False) for v in value]

    def kwargs(self) -> dict[str, Any]:
        """Arguments for hivemind.DHT, leaving the engine's defaults where the user set nothing."""
        kwargs = self.model_dump(exclude_none=True)
        if kwargs.get("client_mode") == "auto":  # decided by trahiv.swarm.start_dht, not an engine value
            del kwargs["client_mode"]
        return kwargs


class AuthConfig(_Section):
    """Join a moderated swarm: the auth server signs this peer's access tokens (see `trahiv auth-server`)."""

    server: str = Field(description="URL of the auth server, e.g. https://auth.example.org")
    token: SecretStr = Field(
        SecretStr(""),
        description=f"the personal token a moderator issued to this user (or token_file, or ${TOKEN_ENV})",
    )
    token_file: str | None = Field(None, description="file holding the token (instead of `token`)")
    timeout: float = Field(10.0, gt=0, description="seconds to wait for the auth server")
    experiment_public_key: str | None = Field(
        None, description="pin the experiment's signing key (OpenSSH 'ssh-rsa ...'); default: the server's"
    )

    @field_validator("server")
    @classmethod
    def _url(cls, value: str) -> str:
        if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", value):
            raise ValueError(f"auth server {value!r} must be an http:// or https:// URL")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _resolve_token(self) -> AuthConfig:
        """The token comes from `token`, else `token_file`, else the environment variable TRAHIV_AUTH_TOKEN. A token
        shown as REDACTED (what `to_dict`, `str(args)` and `training_args.bin` hold) counts as not given."""
        given = self.token.get_secret_value() not in ("", REDACTED)
        if given and self.token_file is not None:
            raise ValueError("give either token or token_file, not both")
        if not given:
            token = _token_from_file(self.token_file) if self.token_file is not None else os.environ.get(TOKEN_ENV)
            if not token:
                raise ValueError(missing_token_message(redacted=self.token.get_secret_value() == REDACTED))
            object.__setattr__(self, "token", SecretStr(token))  # (validate_assignment would run this check again)
        return self


def _token_from_file(path: str) -> str:
    file = Path(path).expanduser()
    try:
        token = file.read_text().strip()
    except OSError as e:
        raise ValueError(f"token_file {path!r} cannot be read ({e.strerror}): give the file with your token") from None
    if not token:
        raise ValueError(f"token_file {path!r} is empty: put the token a moderator issued to you in it")
    return token


def missing_token_message(*, redacted: bool) -> str:
    """Why a moderated swarm's config has no usable token, and the three ways to give one."""
    why = (
        f"the token is {REDACTED} (arguments loaded from to_dict(), JSON or training_args.bin never hold it)"
        if redacted
        else "no token given"
    )
    return (
        f"{why}: set hivemind_config.auth.token, or auth.token_file (a file holding it), or the environment "
        f"variable {TOKEN_ENV}"
    )


class AggregationConfig(_Section):
    """How reducers combine peers' gradients. Parts with non-finite values or invalid weights are always excluded."""

    name: Literal["mean", "centered_clip"] = Field(
        "mean", description="'mean' (hivemind's weighted mean) or 'centered_clip' (robust to Byzantine peers)"
    )
    tau: float = Field(1.0, gt=0, allow_inf_nan=False, description="CenteredClip radius (L2 norm per part)")
    n_iters: int = Field(20, ge=1, description="CenteredClip iterations")


class OptimizerConfig(_Section):
    """Keyword arguments for `hivemind.Optimizer` (the swarm's collaborative optimizer)."""

    run_id: str = Field(description="name of the swarm; peers with the same run_id train together")
    target_batch_size: int = Field(gt=0, description="global samples per collaborative step")
    batch_size_per_step: int | None = Field(
        None, gt=0, description="samples per local step (default: per-device batch x accumulation x processes)"
    )
    matchmaking_time: float = Field(15.0, gt=0, description="seconds to wait for peers to form an averaging group")
    averaging_timeout: float = Field(60.0, gt=0, description="give up an averaging round after this many seconds")
    allreduce_timeout: float | None = Field(None, gt=0, description="bound on one all-reduce")
    next_chunk_timeout: float | None = Field(None, gt=0, description="bound on waiting for the next chunk")
    load_state_timeout: float = Field(600.0, gt=0, description="bound on downloading the state from a peer")
    reuse_grad_buffers: bool = Field(False, description="accumulate into .grad directly (saves memory)")
    offload_optimizer: bool = Field(True, description="keep optimizer state and master params on the CPU")
    delay_optimizer_step: bool | None = Field(None, description="run the optimizer step in the background")
    delay_grad_averaging: bool = Field(False, description="average gradients in the background (needs delay step)")
    delay_state_averaging: bool = Field(
        False, description="average parameters in the background (off: hivemind 1.1.12 corrupts parameters with it)"
    )
    average_state_every: int = Field(5, ge=1, description="average parameters every this many collaborative steps")
    use_local_updates: bool = Field(False, description="local optimizer steps + periodic parameter averaging")
    grad_compression: CompressionName = Field("none", description=f"compression of gradients: {COMPRESSIONS}")
    state_averaging_compression: CompressionName = Field("none", description="compression of averaged parameters")
    load_state_compression: CompressionName = Field("none", description="compression of downloaded state")
    average_opt_statistics: list[str] = Field(default_factory=list, description="optimizer stats to average")
    averager_opts: dict[str, Any] = Field(default_factory=dict, description="extra averager keyword arguments")
    tracker_opts: dict[str, Any] = Field(default_factory=dict, description="extra progress-tracker arguments")
    performance_ema_alpha: float = Field(0.1, gt=0, le=1, description="smoothing of the samples/s estimate")
    shutdown_timeout: float = Field(5.0, gt=0, description="seconds to wait for averagers to stop")
    verbose: bool = Field(False, description="log the swarm's internal events")
    # trahiv's own (not hivemind.Optimizer keywords)
    min_peers: int = Field(1, ge=1, description="at start, wait until this many peers (this one included) are here")
    min_peers_timeout: float = Field(120.0, gt=0, description="give up waiting for min_peers after this many seconds")
    aggregation: AggregationConfig = Field(
        default_factory=AggregationConfig, description="gradient aggregation: {'name', 'tau', 'n_iters'}"
    )
    power_sgd_rank: int | None = Field(
        None, ge=1, description="average gradients with PowerSGD of this rank (low-rank factors, error feedback)"
    )
    allreduce: Literal["auto", "butterfly", "ring"] = Field(
        "auto",
        description="gradient rounds as a ring all-reduce (one stream to the next peer; taken in groups whose peers "
        "all ask for it and accept incoming connections, else the butterfly) or as hivemind's butterfly; 'auto': "
        "the ring, but the butterfly with centered_clip or power_sgd_rank",
    )

    TRAHIV_ONLY: ClassVar[frozenset[str]] = frozenset(
        {"min_peers", "min_peers_timeout", "aggregation", "power_sgd_rank", "allreduce"}
    )

    @property
    def gradient_allreduce(self) -> str:
        """How gradient rounds run: `allreduce`, with 'auto' resolved."""
        if self.allreduce != "auto":
            return self.allreduce
        return "ring" if self.aggregation.name == "mean" and self.power_sgd_rank is None else "butterfly"

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,128}", value):
            raise ValueError(f"run_id {value!r} must be 1-128 letters, digits, '_', '.', '-'")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> OptimizerConfig:
        if self.delay_grad_averaging and self.delay_optimizer_step is False:
            raise ValueError("delay_grad_averaging=True needs delay_optimizer_step=True (or unset)")
        if self.delay_state_averaging and not self.use_local_updates:
            raise ValueError(
                "delay_state_averaging=True is refused: in hivemind 1.1.12 the delayed parameter average lands on top "
                "of newer updates and moves the parameters by the wrong amount (see tests/test_swarm.py); leave it off"
            )
        if self.use_local_updates and (self.reuse_grad_buffers or self.delay_grad_averaging):
            raise ValueError("use_local_updates=True is incompatible with reuse_grad_buffers/delay_grad_averaging")
        if self.power_sgd_rank is not None and self.use_local_updates:
            raise ValueError("power_sgd_rank averages gradients: it cannot be combined with use_local_updates=True")
        if self.allreduce == "ring" and self.aggregation.name != "mean":
            raise ValueError(
                f"allreduce 'ring' cannot be combined with aggregation {self.aggregation.name!r}: a ring sums the "
                "peers' gradients as they pass, and CenteredClip needs every peer's copy at one reducer. Use allreduce "
                "'auto' (the default: the butterfly with centered_clip) or 'butterfly'"
            )
        if self.allreduce == "ring" and self.power_sgd_rank is not None:
            raise ValueError("allreduce 'ring' cannot be combined with power_sgd_rank: PowerSGD runs its own rounds")
        if self.power_sgd_rank is not None and self.aggregation.name != "mean":
            raise ValueError(
                f"power_sgd_rank cannot be combined with aggregation {self.aggregation.name!r}: PowerSGD averages "
                "low-rank factors of the gradients, and a robust aggregate of the factors is not a robust aggregate of "
                "the gradients. Use aggregation 'mean' (non-finite values are still excluded) or drop power_sgd_rank"
            )
        return self


class MetricsConfig(_Section):
    """What this trainer publishes to the swarm's metrics (read by the auxiliary peer's dashboard and trackers)."""

    publish: bool = Field(True, description="publish loss, samples and samples/s to the DHT at each collaborative step")
    name: str | None = Field(
        None, min_length=1, max_length=32, description="display name on the leaderboard (at most 32 printable chars)"
    )

    @field_validator("name")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        if value is not None and not value.isprintable():
            raise ValueError(f"name {value!r} must contain printable characters only")
        return value


class DiLoCoConfig(_Section):
    """DiLoCo (Douillard et al. 2023): each peer trains alone for `inner_steps` with the Trainer's optimizer, then the
    peers average their pseudo-gradients (outer minus local parameters) and take one outer SGD step. See trahiv.diloco.
    """

    inner_steps: int = Field(100, ge=1, description="H: local optimizer steps between two syncs")
    outer_lr: float = Field(0.7, gt=0, allow_inf_nan=False, description="learning rate of the outer SGD step")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="momentum of the outer SGD step")
    nesterov: bool = Field(True, description="Nesterov momentum in the outer step (needs outer_momentum > 0)")
    compression: CompressionName = Field("fp16", description=f"compression of pseudo-gradients: {COMPRESSIONS}")
    fragments: int = Field(
        1,
        ge=1,
        description="streaming DiLoCo: the trainable tensors split into this many fragments of consecutive layers, "
        "synced in turn every inner_steps / fragments steps (each one every inner_steps): the bytes of one sync drop "
        "that many fold",
    )
    overlap: bool = Field(
        False,
        description="sync in the background while the next inner steps run; the outer step is applied when the "
        "average arrives, keeping the inner steps made meanwhile (a sync still pending H steps later is waited for)",
    )
    max_sync_wait: float = Field(
        600.0, gt=0, description="seconds a sync waits at most for slower peers (beyond that it goes on without them)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> DiLoCoConfig:
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0 (e.g. 0.9), or set nesterov=False")
        if self.inner_steps % self.fragments:
            example = self.fragments * max(1, self.inner_steps // self.fragments)
            raise ValueError(
                f"inner_steps={self.inner_steps} is not a multiple of fragments={self.fragments}: fragments sync in "
                f"turn every inner_steps / fragments steps (e.g. inner_steps={example})"
            )
        return self


class HivemindConfig(_Section):
    """The whole `hivemind_config`: `dht` (how to join) and `opt` (how to train together)."""

    dht: DHTConfig = Field(default_factory=DHTConfig, description="hivemind.DHT keyword arguments")
    opt: OptimizerConfig = Field(description="hivemind.Optimizer keyword arguments (run_id, target_batch_size, ...)")
    auth: AuthConfig | None = Field(None, description="join a moderated swarm: {'server', 'token'}")
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig, description="what this peer publishes to the swarm's metrics: {'name', ...}"
    )
    diloco: DiLoCoConfig | None = Field(
        None, description="DiLoCo mode: local training, pseudo-gradients averaged every inner_steps: {'inner_steps'}"
    )

    @model_validator(mode="after")
    def _diloco_alone(self) -> HivemindConfig:
        """DiLoCo replaces hivemind.Optimizer: the options that only make sense inside it are refused with it."""
        if self.diloco is None:
            return self
        opt, clash = self.opt, []
        if opt.use_local_updates:
            clash.append("use_local_updates")
        if opt.power_sgd_rank is not None:
            clash.append("power_sgd_rank")
        if opt.delay_grad_averaging or opt.delay_state_averaging or opt.delay_optimizer_step:
            clash.append("delay_*")
        if clash:
            raise ValueError(
                f"diloco cannot be combined with opt.{', opt.'.join(clash)}: DiLoCo averages pseudo-gradients every "
                "inner_steps itself; remove these keys (or remove 'diloco' to train synchronously)"
            )
        return self

    @classmethod
    def load(cls, value: HivemindConfig | dict | str | Path) -> HivemindConfig:
        """Parse a dict, a JSON string, or a .json/.yaml/.yml file; raise ValueError naming the offending key."""
        if isinstance(value, HivemindConfig):
            return value
        data = _read(value) if isinstance(value, (str, Path)) else value
        if not isinstance(data, dict):
            raise ValueError(f"hivemind_config must be a mapping with 'dht' and 'opt', got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(_explain(e)) from None


def _read(value: str | Path) -> Any:
    text = str(value).strip()
    if text.startswith("{"):
        return _parse_json(text, "the JSON string")
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(f"hivemind_config: {text!r} is neither a dict, a JSON string, nor an existing file")
    try:
        content = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"hivemind_config: cannot read {str(path)!r}: {e}") from None
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(content)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ValueError(
                f"hivemind_config: {str(path)!r} is not valid YAML{where}: {problem}. Fix the file (a mapping with "
                "'dht' and 'opt' sections)"
            ) from None
    return _parse_json(content, repr(str(path)))


def _parse_json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"hivemind_config: {source} is not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}. Fix it (a "
            'mapping like {"dht": {...}, "opt": {"run_id": ..., "target_batch_size": ...}})'
        ) from None


def redact(value: Any) -> Any:
    """`value` (a hivemind_config as the user gave it: a dict, a JSON string, a file path, a HivemindConfig) with
    every secret replaced by REDACTED; a file path stays as it is (the secrets stay in the file)."""
    if isinstance(value, HivemindConfig):
        value = value.model_dump(mode="json")
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            return json.dumps(redact(json.loads(value)))
        except json.JSONDecodeError:
            return REDACTED  # unparsable: it may hold anything
    if isinstance(value, dict):
        return {k: _redact_auth(v) if k == "auth" else redact(v) for k, v in value.items()}
    return value


def _redact_auth(auth: Any) -> Any:
    if not isinstance(auth, dict):
        return REDACTED if auth is not None else None
    return {k: (REDACTED if k in SECRET_KEYS and v else v) for k, v in auth.items()}


def _explain(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        msg = item["msg"].removeprefix("Value error, ")
        lines.append(f"hivemind_config.{where}: {msg}" if where != "(top level)" else f"hivemind_config: {msg}")
    return "invalid hivemind_config:\n  " + "\n  ".join(lines)
