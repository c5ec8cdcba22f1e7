"""An intruder for tests/test_auth.py: `python tests/auth_attacker.py SPEC.json`.

It talks to one honest peer of an authenticated swarm through hivemind's own client code (DHT protocol stubs with a
token authorizer, averager stubs), in phases, and writes what each attempt got to SPEC["out"]/results.json:

- "no_token":   its own RSA identity X, DHT requests carrying no token;
- "other_key":  identity X with a valid token issued for another key Y;
- "legit":      the allowlisted user eve with identity Z and its own valid token (the control: accepted), plus the
                replay of eve's signed DHT request and of her join request, sent again (from X for the join);
- "expired":    identity Z after eve's token expired (not renewed).

Each phase records: dht_store (store_ok list, or None when the request was refused), join (the leader's first code),
aggregate (first code), download (number of state messages received).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2, dht_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from trahiv.auth import AuthClient, PeerAuth
from trahiv.auth.tokens import load_identity


class FixedTokenAuthorizer(TokenAuthorizerBase):
    """Signs requests with `key` and whatever token it is given (none, another key's, an expired one)."""

    def __init__(self, key: RSAPrivateKey, token: AccessToken | None):
        super().__init__(key)
        self._local_access_token = token or AccessToken()
        self.captured: dht_pb2.StoreRequest | None = None

    async def get_token(self) -> AccessToken:
        return self._local_access_token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return True

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False

    async def sign_request(self, request: Any, service_public_key: Any) -> None:
        await super().sign_request(request, service_public_key)
        if isinstance(request, dht_pb2.StoreRequest):
            self.captured = dht_pb2.StoreRequest.FromString(request.SerializeToString())


def code_name(code: int) -> str:
    return str(averaging_pb2.MessageCode.Name(code))


async def try_averaging(
    p2p: P2P, target: PeerID, run_id: str, join: averaging_pb2.JoinRequest, before_each: Any = None
) -> dict[str, Any]:
    """What the target's averagers answer this peer: join (grad averager), aggregate part, download state.
    `before_each()` runs before each of the three calls."""
    before_each = before_each or (lambda: None)
    result: dict[str, Any] = {}
    before_each()
    try:
        stream = await _stub(p2p, target, f"{run_id}_grad_averager", "GradientAverager", "rpc_join_group", join)
        message = await asyncio.wait_for(anext(stream), 10)
        result["join"] = code_name(message.code)
    except Exception as e:
        result["join"] = f"error: {e!r}"[:200]
    before_each()
    try:  # (one try: a refusal is read to the sender's end before the handler returns, trahiv.engine.fixes)
        part = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"x" * 20)
        stub = _stub(p2p, target, f"{run_id}_grad_averager", "GradientAverager", "rpc_aggregate_part", part)
        message = await asyncio.wait_for(anext(await stub), 10)
        result["aggregate"] = code_name(message.code)
    except Exception as e:
        result["aggregate"] = f"error: {e!r}"[:200]
    before_each()
    try:
        stream = await _stub(
            p2p,
            target,
            f"{run_id}_state_averager",
            "TrainingStateAverager",
            "rpc_download_state",
            averaging_pb2.DownloadRequest(),
        )
        count = 0
        async for _ in aiter_timeout(stream, 20):
            count += 1
        result["download"] = count
    except Exception as e:
        result["download"] = f"error: {e!r}"[:200]
    return result


async def _stub(p2p: P2P, peer: PeerID, namespace: str, cls_name: str, method: str, request: Any) -> Any:
    """Call a streaming averaging RPC by the handle name the swarm's averager classes register."""
    from trahiv.engine.optimizer import SwarmOptimizer
    from trahiv.swarm import Swarm

    cls = Swarm.grad_averager_cls if cls_name == "GradientAverager" else SwarmOptimizer.state_averager_cls
    handle = cls._get_handle_name(namespace, method)
    output = averaging_pb2.MessageFromLeader if method == "rpc_join_group" else None
    output = output or (averaging_pb2.AveragingData if method == "rpc_aggregate_part" else averaging_pb2.DownloadData)
    if method == "rpc_aggregate_part":
        return await p2p.iterate_protobuf_handler(peer, handle, _one(request), output)
    return await p2p.iterate_protobuf_handler(peer, handle, request, output)


async def _one(item: Any) -> Any:
    yield item


async def aiter_timeout(stream: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            yield await asyncio.wait_for(anext(stream), max(0.1, deadline - time.monotonic()))
        except StopAsyncIteration:
            return


async def try_store(p2p: P2P, target: PeerID, authorizer: TokenAuthorizerBase, key: str) -> list[bool] | None:
    protocol = await DHTProtocol.create(
        p2p, DHTID.generate(), bucket_size=20, depth_modulo=5, num_replicas=5, wait_timeout=5,
        authorizer=authorizer, client_mode=True,
    )  # fmt: skip
    value = MSGPackSerializer.dumps("intruder was here")
    stored = await protocol.call_store(target, [DHTID.generate(source=key)], [value], get_dht_time() + 300)
    return None if stored is None else [bool(ok) for ok in stored]


async def replay_store(p2p: P2P, target: PeerID, request: dht_pb2.StoreRequest) -> str:
    """Send an already-signed request again, byte for byte."""
    stub = DHTProtocol._stub_type(p2p, target, None) if DHTProtocol._stub_type else None
    if stub is None:
        DHTProtocol._collect_rpc_handlers()
        stub = DHTProtocol._stub_type(p2p, target, None)
    try:
        response = await stub.rpc_store(request, timeout=5)
        return f"accepted: {list(response.store_ok)}"
    except Exception as e:
        return f"refused: {type(e).__name__}"


async def read_key(p2p: P2P, target: PeerID, authorizer: TokenAuthorizerBase, key: str) -> bool:
    protocol = await DHTProtocol.create(
        p2p, DHTID.generate(), bucket_size=20, depth_modulo=5, num_replicas=5, wait_timeout=5,
        authorizer=authorizer, client_mode=True,
    )  # fmt: skip
    found = await protocol.call_find(target, [DHTID.generate(source=key)])
    return bool(found) and any(value is not None for value, _ in found.values())


async def main(spec: dict[str, Any]) -> dict[str, Any]:
    out = Path(spec["out"])
    target = PeerID.from_base58(spec["target_peer_id"])
    run_id = spec["run_id"]
    results: dict[str, Any] = {}
    join = averaging_pb2.JoinRequest(schema_hash=b"s" * 20, expiration=get_dht_time() + 5, group_key=f"{run_id}.0b")

    # identity X: no token, then a valid token for another key
    x_path = str(out / "x.key")
    x_key = load_identity(x_path)
    x = await P2P.create(
        initial_peers=spec["target_maddrs"], identity_path=x_path, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )
    client = AuthClient(spec["server"], spec["eve_token"], run_id)
    other_token, _ = client.access_token(RSAPrivateKey().get_public_key().to_bytes())
    for phase, token in (("no_token", None), ("other_key", other_token)):
        authorizer = FixedTokenAuthorizer(x_key, token)
        results[phase] = {"dht_store": await try_store(x, target, authorizer, f"{run_id}_intruder_{phase}")}
        results[phase].update(await try_averaging(x, target, run_id, join))
        print(phase, results[phase], flush=True)

    # identity Z: eve, allowlisted, with her own token published in the swarm's DHT (the control)
    import hivemind

    eve = PeerAuth.start(spec["server"], spec["eve_token"], run_id, identity_path=str(out / "z.key"))
    dht = hivemind.DHT(
        initial_peers=spec["target_maddrs"], host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, start=True,
        **eve.dht_kwargs(),
    )  # fmt: skip
    eve.attach(dht)
    eve.close()  # no renewal in the background from here on
    z = await dht.replicate_p2p()
    authorizer = FixedTokenAuthorizer(eve.private_key, eve.token)
    expires_at = 0.0

    def renew() -> None:
        """A fresh token for eve's next call (published in the DHT like the others; the token and its expiry read
        together after the renewal). Her token lives 10 s: on a loaded machine one call of the legit phase took
        seconds, and the whole phase, run with the token of its start, outlived it (CI: the part and the download
        were refused, 2.5-3.5 s after expiry)."""
        nonlocal expires_at
        eve.renew()
        authorizer._local_access_token = eve.token
        expires_at = eve.verify(eve.token).expires_at

    renew()
    results["legit"] = {"dht_store": await try_store(z, target, authorizer, f"{run_id}_eve_legit")}
    results["legit"]["peer_id"] = z.peer_id.to_base58()
    results["legit"]["replayed_store"] = await replay_store(z, target, authorizer.captured)
    time.sleep(1.5)  # the gate reads the DHT at most once a second
    results["legit"].update(await try_averaging(z, target, run_id, join, before_each=renew))
    results["legit"]["token_left_s"] = round(expires_at - time.time(), 2)  # after the download: the token was valid
    renew()
    results["legit"]["replayed_join_from_x"] = (await try_averaging(x, target, run_id, join))["join"]
    results["legit"]["reads_intruder_keys"] = [
        await read_key(z, target, authorizer, f"{run_id}_intruder_{phase}") for phase in ("no_token", "other_key")
    ]
    results["legit"]["reads_own_key"] = await read_key(z, target, authorizer, f"{run_id}_eve_legit")
    print("legit", results["legit"], flush=True)

    await asyncio.sleep(max(0.0, expires_at - time.time() + 1.5))
    results["expired"] = {"dht_store": await try_store(z, target, authorizer, f"{run_id}_eve_expired")}
    results["expired"].update(await try_averaging(z, target, run_id, join))
    dht.shutdown()
    await x.shutdown()
    return results


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    results = asyncio.run(main(spec))
    (Path(spec["out"]) / "results.json").write_text(json.dumps(results, indent=1))
