"""Following a moderator's revert order: the whole swarm returns to a checkpoint's weights, optimizer state and step.

1. The moderator runs `trahiv revert --checkpoint DIR` (trahiv/cli/revert.py): a peer that serves the checkpoint's
   state (the aux peer's format, `trahiv.auxiliary.checkpoints`) and asks the auth server for a revert order naming
   that peer, the checkpoint's step and the digest of its trainable tensors. The server signs the order with the
   experiment key (`trahiv.auth.revert`).
2. Every peer of a moderated swarm runs a `RevertWatcher`: it reads orders from the DHT (`{run_id}_revert`, every
   `dht_period` seconds) and from the auth server (every `server_period` seconds), keeps only those signed by the
   experiment key for this run (forged or unsigned ones are logged and ignored), and republishes in the DHT an order
   it got from the server, so that peers learn of it within seconds.
3. A trainer applies a new order once, between two local steps (`RevertFollower`, called by SwarmOptimizer.step):
   it downloads the state from the order's source only, checks it (shapes, finite values, step, digest), loads
   parameters and optimizer state, sets its collaborative step and learning-rate schedule to the checkpoint's, and
   drops the gradients it accumulated, then announces that it applied the order (`{run_id}_reverted`). For `grace`
   seconds afterwards it counts only the progress of peers that applied it too, and downloads state only from them
   (to catch up with one more than a step ahead): peers still training in the old state must not pull it back.

Orders that already existed when a peer started (and are older than `grace`) are not applied by it: a joining peer
downloads the swarm's current state instead.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hivemind.utils import get_dht_time

from trahiv.auth.client import AuthClient, AuthError
from trahiv.auth.revert import RevertOrder, RevertOrderError, SignedRevertOrder, verify_order
from trahiv.engine.state import download_state, leave_rounds, load_state

if TYPE_CHECKING:
    from trahiv.auxiliary.checkpoints import SwarmState
    from trahiv.engine.optimizer import SwarmOptimizer

logger = logging.getLogger("trahiv.revert")

__all__ = [
    "GRACE_SECONDS",
    "DiLoCoRevertFollower",
    "RevertFollower",
    "RevertWatcher",
    "fetch_server_order",
    "parameters_digest",
    "revert_key",
    "reverted_key",
    "serve_state",
    "state_from_trainer_checkpoint",
]

GRACE_SECONDS = 60.0  # after a revert: trust no progress record far ahead, download no state
ORDER_TTL = 7 * 86400.0  # seconds an order stays in the DHT
RETRY_SECONDS = 3.0  # between attempts to download the checkpoint's state


def revert_key(run_id: str) -> str:
    """The DHT key of a run's revert orders (subkey: a digest of the signed order, value: its JSON bytes)."""
    return f"{run_id}_revert"


def reverted_key(run_id: str) -> str:
    """The DHT key where peers announce the newest order they applied (subkey: peer ID, value: revert_id)."""
    return f"{run_id}_reverted"


def parameters_digest(tensors: Sequence[torch.Tensor]) -> str:
    """SHA-256 over the dtypes, shapes and bytes of the trainable tensors (in the swarm's order)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{flat.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fetch_server_order(client: AuthClient) -> SignedRevertOrder | None:
    """The newest revert order of the client's run on the auth server (AuthError if unreachable or malformed)."""
    reply = client._request("GET", "/revert")
    value = reply.get("revert")
    if value is None:
        return None
    try:
        return SignedRevertOrder.model_validate(value)
    except ValueError as e:
        raise AuthError(f"the auth server at {client.server} answered a malformed revert order: {e}") from None


class RevertWatcher:
    """The newest valid revert order of a run, from the DHT and the auth server, polled in a thread."""

    def __init__(
        self,
        dht: Any,
        run_id: str,
        experiment_public_key: bytes,
        client: AuthClient | None = None,
        *,
        dht_period: float = 1.0,
        server_period: float = 5.0,
        grace: float = GRACE_SECONDS,
    ):
        self.dht, self.run_id, self.experiment_public_key, self.client = dht, run_id, experiment_public_key, client
        self.dht_period, self.server_period, self.grace = dht_period, server_period, grace
        self.baseline_id = 0  # orders up to this one predate this peer: not applied
        self.ignored = 0  # invalid orders seen (forged, unsigned, another run's)
        self._newest: SignedRevertOrder | None = None
        self._lock = threading.Lock()
        self._in_dht: set[str] = set()
        self.reverted: dict[str, int] = {}  # peer ID -> the newest order it applied (announced in the DHT)
        self._reported: set[str] = set()
        self._next_server_poll = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def newest(self) -> SignedRevertOrder | None:
        with self._lock:
            return self._newest

    def start(self) -> RevertWatcher:
        try:
            self.poll()
        except Exception as e:  # the DHT may not answer yet: the thread tries again
            logger.debug(f"Could not check for revert orders: {e!r}")
        newest = self.newest
        if newest is not None and newest.order.issued_at < time.time() - self.grace:
            self.baseline_id = newest.order.revert_id
        self._thread = threading.Thread(target=self._loop, name="trahiv-revert-watcher", daemon=True)
        self._thread.start()
        return self

    def pending(self, applied_id: int) -> SignedRevertOrder | None:
        """The newest order if it is newer than `applied_id` and than the orders that predate this peer."""
        newest = self.newest
        if newest is None or newest.order.revert_id <= max(applied_id, self.baseline_id):
            return None
        return newest

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # --- polling ----------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.dht_period):
            try:
                self.poll()
            except Exception as e:  # the DHT may be shutting down: never kill the thread silently
                logger.debug(f"Could not check for revert orders: {e!r}")

    def poll(self) -> None:
        self._poll_dht()
        if self.client is not None and time.monotonic() >= self._next_server_poll:
            self._next_server_poll = time.monotonic() + self.server_period
            try:
                signed = fetch_server_order(self.client)
            except AuthError as e:
                logger.debug(f"Could not fetch revert orders: {e}")
                return
            if signed is not None and self.consider(signed, "the auth server") and _subkey(signed) not in self._in_dht:
                self.publish(signed)

    def _poll_dht(self) -> None:
        found = self.dht.get(reverted_key(self.run_id), latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        values = {str(peer): getattr(entry, "value", None) for peer, entry in entries.items()}
        self.reverted = {peer: v for peer, v in values.items() if isinstance(v, int) and not isinstance(v, bool)}
        found = self.dht.get(revert_key(self.run_id), latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        seen = set()
        for subkey, entry in entries.items():
            value = getattr(entry, "value", None)
            try:
                signed = SignedRevertOrder.from_bytes(value)
            except RevertOrderError as e:
                self._ignore(str(subkey), str(e))
                continue
            seen.add(_subkey(signed))
            self.consider(signed, "the DHT", report_as=str(subkey))
        self._in_dht = seen

    def consider(self, signed: SignedRevertOrder, origin: str, report_as: str | None = None) -> bool:
        """Keep `signed` if it is valid and newer than the newest order known; return True if it was kept."""
        try:
            order = verify_order(signed, self.experiment_public_key, self.run_id)
        except RevertOrderError as e:
            self._ignore(report_as or _subkey(signed), f"{e} (from {origin})")
            return False
        with self._lock:
            if self._newest is not None and self._newest.order.revert_id >= order.revert_id:
                return False
            self._newest = signed
        logger.info(f"Revert order #{order.revert_id} from {origin}: back to step {order.step} ({order.reason!r})")
        return True

    def _ignore(self, key: str, reason: str) -> None:
        if key not in self._reported:
            self._reported.add(key)
            self.ignored += 1
            logger.warning(f"Ignoring a revert order: {reason}")

    def publish(self, signed: SignedRevertOrder) -> None:
        """Store `signed` in the DHT (in the background), where peers find it within `dht_period`."""
        self.dht.store(
            revert_key(self.run_id),
            subkey=_subkey(signed),
            value=signed.to_bytes(),
            expiration_time=get_dht_time() + ORDER_TTL,
            return_future=True,
        )

    def announce(self, revert_id: int) -> None:
        """Tell the swarm that this peer applied order `revert_id` (peers in their grace period trust only those)."""
        self.reverted[self.dht.peer_id.to_base58()] = revert_id
        self.dht.store(
            reverted_key(self.run_id),
            subkey=self.dht.peer_id.to_base58(),
            value=revert_id,
            expiration_time=get_dht_time() + self.grace + 60.0,
            return_future=True,
        )


def _subkey(signed: SignedRevertOrder) -> str:
    """Content-addressed: a forged order cannot overwrite a genuine one under the same subkey."""
    return hashlib.sha256(signed.to_bytes()).hexdigest()[:32]


# --- applying an order ----------------------------------------------------------------------------------------------


class RevertFollower:
    """A trainer's side: apply each new order once (`maybe_apply`, between local steps), then a grace period during
    which this peer trains only with peers that applied it too, and catches up only with them."""

    def __init__(self, watcher: RevertWatcher, grace: float | None = None):
        self.watcher = watcher
        self.grace = watcher.grace if grace is None else grace
        self.applied_id = watcher.baseline_id
        self.applied: list[RevertOrder] = []
        self.grace_until = 0.0
        self.reverted_step = -1
        self._retry_at = 0.0

    def attach(self, opt: SwarmOptimizer) -> RevertFollower:
        opt.revert = self
        opt.tracker.peer_filter = self.allowed_peers
        return self

    def in_grace(self) -> bool:
        return time.monotonic() < self.grace_until

    def allowed_peers(self) -> set[str] | None:
        """During the grace period: the peers that applied the same order (this one included); None otherwise."""
        if not self.in_grace():
            return None
        own = self.watcher.dht.peer_id.to_base58()
        return {peer for peer, revert_id in self.watcher.reverted.items() if revert_id == self.applied_id} | {own}

    def maybe_apply(self, opt: SwarmOptimizer) -> bool:
        """Apply the pending order, or catch up with peers that applied it; True if the state was replaced (the
        caller drops its gradients)."""
        if time.monotonic() < self._retry_at:
            return False
        signed = self.watcher.pending(self.applied_id)
        if signed is not None:
            return self._apply(opt, signed.order)
        if self.in_grace():  # like hivemind's sync check, but downloading only from peers that reverted
            ahead, local = opt.tracker.global_epoch, opt.local_epoch
            if ahead > local + 1 or (ahead > local and local == self.reverted_step):
                return self._catch_up(opt)
        return False

    def _apply(self, opt: SwarmOptimizer, order: RevertOrder) -> bool:
        leave_rounds(opt)

        def accept(peer: str, priority: Any) -> bool:
            return peer == order.source if order.source else priority == order.step

        what = f"revert order #{order.revert_id}"
        loaded = _guarded(download_state, opt, accept, checkpoint_check(order.step, order.parameters_sha256), what=what)
        if loaded is None:
            self._retry_at = time.monotonic() + RETRY_SECONDS
            logger.warning(f"Revert order #{order.revert_id}: the checkpoint's state is not available yet; retrying")
            return False
        self.applied_id, self.grace_until = order.revert_id, time.monotonic() + self.grace
        self.reverted_step = order.step
        self.applied.append(order)
        load_state(opt, *loaded, step=order.step)
        self.watcher.announce(order.revert_id)
        logger.info(
            f"Reverted to collaborative step {order.step} (order #{order.revert_id}); for {self.grace:.0f} s, this "
            "peer trains only with peers that reverted too"
        )
        return True

    def _catch_up(self, opt: SwarmOptimizer) -> bool:
        """A peer that applied the order is ahead by more than a step: download its state (only theirs)."""
        allowed, local = self.allowed_peers() or set(), opt.local_epoch
        leave_rounds(opt)

        def accept(peer: str, priority: Any) -> bool:
            return peer in allowed and isinstance(priority, int | float) and int(priority) > local

        what = f"catching up after revert order #{self.applied_id}"
        loaded = _guarded(download_state, opt, accept, checkpoint_check(None, ""), what=what)
        if loaded is None:
            self._retry_at = time.monotonic() + RETRY_SECONDS
            return False
        metadata, tensors = loaded
        load_state(opt, metadata, tensors, step=int(metadata["epoch"]))
        logger.info(f"Caught up with the peers that applied revert order #{self.applied_id}: step {opt.local_epoch}")
        return True


class DiLoCoRevertFollower(RevertFollower):
    """[DiLoCo] A DiLoCo trainer's side (trahiv.diloco), checked between two inner steps: download the order's outer
    state (outer parameters + outer momenta of the checkpoint's outer step, `order.step`) from its source only, check
    step and digest, and restart from it: outer parameters and momenta as in the checkpoint, the model set to them,
    the round's inner steps dropped, the inner optimizer's statistics reset (they were built along the reverted
    trajectory; the Trainer's LR schedule follows the new step). For `grace` seconds it then sees only the progress of
    peers that applied the order (peers still at later outer steps would otherwise pull it back), and its sync points
    wait for the peers that have not applied it yet (bounded by the grace period and `max_sync_wait`): a peer that
    reverted first would otherwise sync alone and run ahead, and the others would download its state."""

    def attach(self, opt: Any) -> DiLoCoRevertFollower:  # type: ignore[override]
        opt.revert = self
        return self

    def maybe_apply(self, opt: Any) -> bool:  # type: ignore[override]
        if time.monotonic() < self._retry_at:
            return False
        signed = self.watcher.pending(self.applied_id)
        if signed is None:
            return False
        order = signed.order
        loaded = None
        if order.source:
            try:
                loaded = opt.averager.load_state_from(order.source, opt.config.opt.load_state_timeout)
            except Exception as e:
                logger.warning(f"Revert order #{order.revert_id}: the state download failed: {e!r}")
        check = checkpoint_check(order.step, order.parameters_sha256)
        reason = "not available" if loaded is None else check(loaded[0], loaded[1], len(opt.outer_params))
        if loaded is None or reason is not None:
            self._retry_at = time.monotonic() + RETRY_SECONDS
            logger.warning(f"Revert order #{order.revert_id}: the checkpoint's outer state is {reason}; retrying")
            return False
        self.applied_id, self.grace_until = order.revert_id, time.monotonic() + self.grace
        self.reverted_step = order.step
        self.applied.append(order)
        opt.revert_to(*loaded)
        self.watcher.announce(order.revert_id)
        logger.info(f"Reverted to outer step {order.step} (order #{order.revert_id})")
        return True


def checkpoint_check(step: int | None, digest: str) -> Callable[[dict, list[torch.Tensor], int], str | None]:
    """The checks of a downloaded state beyond the generic ones: the order's `step` and the trainable tensors'
    `digest`, where given."""

    def check(metadata: dict, tensors: list[torch.Tensor], num_parameters: int) -> str | None:
        if step is not None and metadata.get("epoch") != step:
            return f"it is the state of step {metadata.get('epoch')}, not of step {step}"
        if digest and parameters_digest(tensors[:num_parameters]) != digest:
            return "its trainable tensors differ from the checkpoint's (SHA-256 mismatch)"
        return None

    return check


def _guarded(download: Callable[..., Any], *args: Any, what: str, **kwargs: Any) -> Any:
    """A failed download (timeout, averager error) is retried later: it must never stop training."""
    try:
        return download(*args, what=what, **kwargs)
    except Exception as e:
        logger.warning(f"{what}: the state download failed: {e!r}")
        return None


# --- checkpoints ----------------------------------------------------------------------------------------------------


def state_from_trainer_checkpoint(path: str | Path) -> tuple[SwarmState, torch.nn.Module]:
    """The swarm state a trahiv Trainer saved in `path` (output_dir/checkpoint-N: model, optimizer.pt with
    hivemind's local_epoch), and the model; `save_checkpoint` (auxiliary.checkpoints) makes it a checkpoint."""
    import transformers
    from hivemind.utils.nested import nested_flatten

    from trahiv.auxiliary.checkpoints import SwarmState, swarm_parameters

    path = Path(path)
    if not (path / "optimizer.pt").is_file():
        raise ValueError(f"{path} is not a Trainer checkpoint (no optimizer.pt)")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    state_dict = torch.load(path / "optimizer.pt", weights_only=True)
    if "diloco" in state_dict:  # [DiLoCo] the outer state (the model file holds the half-way inner parameters)
        return diloco_state(state_dict["diloco"]), model
    step = state_dict["state"].pop("local_epoch", None)
    if not isinstance(step, int):
        raise ValueError(f"{path}/optimizer.pt has no collaborative step (local_epoch): not saved by a swarm trainer")
    metadata: list[dict[str, Any]] = []
    tensors: list[torch.Tensor] = []
    for value in nested_flatten(state_dict):  # hivemind's dump_optimizer_state, from the saved state dict
        if isinstance(value, torch.Tensor):
            metadata.append({"type": "tensor", "index": len(tensors)})
            tensors.append(value)
        else:
            metadata.append({"type": "value", "value": value})
    parameters = [p.detach().clone() for _, p in swarm_parameters(model)]
    return SwarmState(step, parameters, metadata, tensors), model


def diloco_state(saved: dict[str, Any]) -> SwarmState:
    """[DiLoCo] The outer state a DiLoCo trainer saved (`DiLoCoOptimizer.state_dict()["diloco"]`) in the aux peer's
    checkpoint format (trahiv.auxiliary.diloco): the outer parameters, the outer momenta as optimizer tensors."""
    from trahiv.auxiliary.checkpoints import SwarmState
    from trahiv.auxiliary.diloco import momentum_metadata

    params, momenta = list(saved["outer_params"]), list(saved["momenta"])
    return SwarmState(int(saved["outer_step"]), params, momentum_metadata(len(momenta)), momenta)


def serve_state(dht: Any, run_id: str, state: SwarmState, gate: Any) -> tuple[Any, str]:
    """An averager serving `state` to the swarm's trainers, and the DHT prefix it declares it under: a DiLoCo swarm's
    outer state under `{run_id}_diloco` (trahiv.auxiliary.diloco), else under `{run_id}_state_averager`."""
    from trahiv.auxiliary.diloco import DiLoCoMirror, is_diloco_state
    from trahiv.engine.gate import gated
    from trahiv.engine.state import StateMirror

    if is_diloco_state(state):
        shapes = [tuple(t.shape) for t in state.parameters]
        mirror = gated(DiLoCoMirror, gate)(dht=dht, run_id=run_id, shapes=shapes)
        mirror.serve(state)
        return mirror, f"{run_id}_diloco"
    mirror = gated(StateMirror, gate)(dht=dht, run_id=run_id)
    mirror.serve(state)
    return mirror, f"{run_id}_state_averager"
