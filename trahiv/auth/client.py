"""The peer's side of auth: get an access token from the auth server, renew it, publish it, sign DHT requests with it.

`PeerAuth.start(config, run_id, identity_path)` runs before the DHT starts and fails with `AuthError` (banned, unknown
user, unknown experiment, server unreachable) before anything else happens. Its `dht_kwargs()` give the DHT the RSA
identity the token is bound to and a `SwarmAuthorizer`, so that every DHT request and response carries a valid token
(hivemind checks signatures, nonces and times). `attach(dht)` publishes the token under `{run_id}_auth` for the
averagers' gate (`trahiv.auth.gate`) and renews it in a thread at half its lifetime, reporting this peer's
contribution to the server at the same time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from trahiv.auth.tokens import AccessToken, TokenError, TokenInfo, load_identity, verify_access_token

logger = logging.getLogger("trahiv.auth")

__all__ = ["AuthClient", "AuthError", "PeerAuth", "SwarmAuthorizer", "auth_key"]

RENEW_AT = 0.5  # renew when this fraction of the lifetime is left
RETRY_PERIOD = 2.0  # seconds between attempts while the server does not answer


def auth_key(run_id: str) -> str:
    """The DHT key under which peers publish their access tokens (subkey: peer ID)."""
    return f"{run_id}_auth"


def http_error_detail(error: urllib.error.HTTPError) -> str:
    """The reason the auth server gave (FastAPI's `detail`), else the HTTP reason phrase."""
    try:
        return str(json.loads(error.read()).get("detail", error.reason))
    except Exception:
        return str(error.reason)


class AuthError(RuntimeError):
    """The auth server refused this peer, or could not be reached; the message says which and why."""


@dataclass(frozen=True)
class AuthClient:
    """HTTP client of the auth server for one user of one experiment (plain data: it is forked into the DHT)."""

    server: str
    user_token: str
    run_id: str
    timeout: float = 10.0

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.server.rstrip('/')}/api/experiments/{self.run_id}{path}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.user_token}")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                result: dict[str, Any] = json.loads(response.read())
                return result
        except urllib.error.HTTPError as e:
            raise AuthError(
                f"the auth server at {self.server} refused (HTTP {e.code}): {http_error_detail(e)}"
            ) from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise AuthError(f"could not reach the auth server at {self.server}: {e}") from None

    def experiment_public_key(self) -> bytes:
        return str(self._request("GET", "")["public_key"]).encode()

    def access_token(self, public_key: bytes, contribution: dict[str, Any] | None = None) -> tuple[AccessToken, bytes]:
        """A fresh access token for `public_key`, and the experiment's public key the server names."""
        body: dict[str, Any] = {"public_key": public_key.decode()}
        if contribution is not None:
            body["contribution"] = contribution
        reply = self._request("POST", "/access_token", body)
        try:
            token = AccessToken(
                username=str(reply["username"]),
                public_key=str(reply["public_key"]).encode(),
                expiration_time=str(reply["expiration_time"]),
                signature=str(reply["signature"]).encode(),
            )
            return token, str(reply["experiment_public_key"]).encode()
        except (KeyError, TypeError) as e:
            raise AuthError(f"the auth server at {self.server} answered a malformed access token: {e}") from None


class SwarmAuthorizer(TokenAuthorizerBase):
    """hivemind's token protocol for DHT RPCs with trahiv's tokens: valid = signed by the experiment key, unexpired."""

    def __init__(
        self,
        client: AuthClient,
        private_key: RSAPrivateKey,
        experiment_public_key: bytes,
        token: AccessToken | None = None,
    ):
        super().__init__(private_key)
        self.client = client
        self.experiment_public_key = experiment_public_key
        self._local_access_token = token
        self._lifetime = self._remaining(token) if token is not None else 0.0
        self._retry_after = 0.0

    def _verify(self, token: AccessToken) -> TokenInfo:
        return verify_access_token(token, self.experiment_public_key, get_dht_time())

    def _remaining(self, token: AccessToken) -> float:
        try:
            return self._verify(token).expires_at - get_dht_time()
        except (TokenError, ValueError):
            return 0.0

    async def get_token(self) -> AccessToken:
        """A fresh token; while the server refuses or is unreachable, the current one as long as it is valid."""
        loop = asyncio.get_running_loop()
        public_key = self.local_public_key.to_bytes()
        try:
            token, _ = await loop.run_in_executor(None, self.client.access_token, public_key)
        except AuthError as e:
            current = self._local_access_token
            self._retry_after = time.monotonic() + RETRY_PERIOD
            if current is not None and self._remaining(current) > 0:
                logger.warning(f"Keeping the current access token for DHT requests: {e}")
                return current
            raise
        self._lifetime = max(self._lifetime, self._remaining(token))
        return token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return self._remaining(access_token) > 0

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        """Renew when less than RENEW_AT of the lifetime is left (not more often than every RETRY_PERIOD on errors)."""
        remaining = self._remaining(access_token)
        if remaining <= 0:
            return True
        return remaining < RENEW_AT * self._lifetime and time.monotonic() >= self._retry_after


class PeerAuth:
    """This peer's access token: obtained before the DHT starts, published in the DHT, renewed in the background."""

    def __init__(self, client: AuthClient, identity_path: str, temporary_dir: str | None, pinned_key: bytes | None):
        self.client = client
        self.identity_path = identity_path
        self._temporary_dir = temporary_dir
        self.private_key = load_identity(identity_path)
        self.public_key = self.private_key.get_public_key().to_bytes()
        self.session = secrets.token_hex(8)
        self.token, self.experiment_public_key = client.access_token(self.public_key)
        if pinned_key is not None and pinned_key.strip() != self.experiment_public_key.strip():
            raise AuthError(
                f"the auth server at {client.server} signs {client.run_id!r} with another key than the pinned "
                "experiment_public_key: refusing to join (wrong server, or the experiment was re-created)"
            )
        self.info = self.verify(self.token)
        self.username = self.info.username
        self.lifetime = max(self.info.expires_at - time.time(), 1.0)
        self._dht: Any = None
        self._contribution: Callable[[], tuple[int, int]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refused: str | None = None  # why the server last refused a renewal (banned...)

    @classmethod
    def start(
        cls,
        server: str,
        user_token: str,
        run_id: str,
        identity_path: str | None = None,
        timeout: float = 10.0,
        experiment_public_key: str | None = None,
    ) -> PeerAuth:
        """Get this peer's first access token (raises AuthError with the reason if refused or unreachable)."""
        temporary_dir = None
        if identity_path is None:  # a fresh RSA identity: the token names the peer ID derived from it
            temporary_dir = tempfile.mkdtemp(prefix="trahiv-identity-")
            identity_path = str(Path(temporary_dir) / "identity.key")
        client = AuthClient(server, user_token, run_id, timeout)
        try:
            auth = cls(
                client, identity_path, temporary_dir, experiment_public_key.encode() if experiment_public_key else None
            )
        except BaseException:
            if temporary_dir is not None:
                shutil.rmtree(temporary_dir, ignore_errors=True)
            raise
        logger.info(f"Authenticated as {auth.username!r} for {run_id!r} (access token valid {auth.lifetime:.0f} s)")
        return auth

    def verify(self, token: AccessToken) -> TokenInfo:
        try:
            return verify_access_token(token, self.experiment_public_key, time.time())
        except TokenError as e:
            raise AuthError(f"the auth server at {self.client.server} issued an unusable token: {e}") from None

    def dht_kwargs(self) -> dict[str, Any]:
        """hivemind.DHT arguments: the identity the token is bound to and the authorizer of DHT RPCs."""
        authorizer = SwarmAuthorizer(self.client, self.private_key, self.experiment_public_key, self.token)
        kwargs: dict[str, Any] = {"identity_path": self.identity_path, "authorizer": authorizer}
        if self._temporary_dir is not None:
            kwargs["check_if_identity_free"] = False  # a key made a moment ago is nobody else's
        return kwargs

    def attach(self, dht: Any, contribution: Callable[[], tuple[int, int]] | None = None) -> None:
        """Publish the token in `dht` and keep it fresh; `contribution()` -> (samples, collaborative step)."""
        if dht.peer_id != self.info.peer_id:
            raise AuthError(f"the DHT runs as {dht.peer_id} but the access token names {self.info.peer_id}")
        self._dht, self._contribution = dht, contribution
        self.publish()
        self._thread = threading.Thread(target=self._renew_loop, name="trahiv-auth", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        self._dht.store(
            auth_key(self.client.run_id),
            subkey=self.info.peer_id.to_base58(),
            value=self.token.SerializeToString(),
            expiration_time=self.info.expires_at,
        )

    def renew(self) -> None:
        """Get a new token (reporting the contribution) and publish it; AuthError if the server refuses."""
        report = None
        if self._contribution is not None:
            samples, steps = self._contribution()
            report = {"session": self.session, "samples": int(samples), "steps": int(steps)}
        token, _ = self.client.access_token(self.public_key, report)
        self.token, self.info = token, self.verify(token)
        self.refused = None
        if self._dht is not None:
            self.publish()

    def _renew_loop(self) -> None:
        while not self._stop.wait(max(0.0, self.info.expires_at - time.time() - RENEW_AT * self.lifetime)):
            try:
                self.renew()
            except AuthError as e:
                if self.refused != str(e):
                    logger.error(
                        f"Could not renew this peer's access token: {e}. Other peers stop accepting it when the "
                        f"current token expires ({time.strftime('%H:%M:%S', time.localtime(self.info.expires_at))})"
                    )
                self.refused = str(e)
                self._stop.wait(RETRY_PERIOD)
            except Exception as e:  # the DHT may be shutting down: never kill the thread silently
                logger.warning(f"Error while renewing the access token: {e!r}")
                self._stop.wait(RETRY_PERIOD)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._temporary_dir is not None:
            shutil.rmtree(self._temporary_dir, ignore_errors=True)
