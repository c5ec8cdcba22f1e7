"""Robust aggregation inside hivemind's decentralized all-reduce.

In hivemind's butterfly all-reduce every peer reduces one slice ("part") of the averaged tensors: all senders stream
their copy of that part to it, and it returns the aggregate. hivemind 1.1.12 sums the parts as they arrive, so one
sender with `[nan, 1e30]` poisons every peer. Here the reducer buffers every sender's copy of the current part and
aggregates once all expected copies arrived:

- always: a copy with a non-finite value, a wrong shape, or a weight that is not finite and >= 0 is excluded from the
  round (weight 0) and its sender is logged (WARNING, by peer ID, once per round);
- then the weighted mean (hivemind's result) or CenteredClip (Karimireddy et al. 2020), which bounds how far one
  sender can move the aggregate, whatever it sends.

What peers receive is still decoded by hivemind's protobuf messages and compression deserializers: nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter, attach_event_on_finished, azip
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

logger = logging.getLogger("trahiv.averaging")
WEIGHT_SLACK = 1.25  # a gradient round's weight may exceed the samples a peer reported by this factor (staleness)
MAX_EXTRAPOLATION_S = 60.0  # reported samples are extrapolated at the reported rate for at most this long
CAPS_FETCH_TIMEOUT_S = 2.0
MAX_STATE_SOURCES = 8  # peers asked for their state, one after the other, before keeping the local state

__all__ = [
    "Aggregation",
    "NoUsablePartError",
    "RobustAllReduceRunner",
    "RobustGradientAverager",
    "RobustTensorPartReducer",
    "RobustTrainingStateAverager",
    "CheckedStateDownload",
    "EpochKeyedMatchmaking",
    "epoch_group_bits",
    "state_rejection_reason",
    "aggregate",
    "centered_clip",
    "rejection_reason",
    "weighted_mean",
    "weighted_median",
]


@dataclass(frozen=True)
class Aggregation:
    """How a reducer combines the senders' copies of one part: `mean` (hivemind's weighted mean) or `centered_clip`
    (`n_iters` clipping iterations with radius `tau`, started from the weighted coordinate median, each copy's weight
    capped at the median copy's)."""

    name: Literal["mean", "centered_clip"] = "mean"
    tau: float = 1.0
    n_iters: int = 20

    def __post_init__(self) -> None:
        if self.name not in ("mean", "centered_clip"):
            raise ValueError(f"unknown aggregation {self.name!r}: use 'mean' or 'centered_clip'")
        if not (self.tau > 0 and self.tau != float("inf")) or self.n_iters < 1:
            raise ValueError(f"aggregation needs a finite tau > 0 and n_iters >= 1, got {self}")


MEAN = Aggregation()


class NoUsablePartError(AllreduceException):
    """Every copy of a part was excluded: its senders keep their local values for it."""


# --- aggregation of one part ----------------------------------------------------------------------------------------


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_i w_i x_i / sum_i w_i, summed in the given order like hivemind's streaming reducer."""
    total = parts[0] * weights[0]
    for part, weight in zip(parts[1:], weights[1:], strict=True):
        total.add_(part, alpha=weight)
    return total.div_(sum(weights))


def weighted_median(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise weighted median of `stacked` [senders, ...] (the lower one on a tie)."""
    values, order = stacked.sort(dim=0)
    cumulative = weights[order].cumsum(dim=0)
    below_half = (cumulative < cumulative[-1:] / 2).sum(dim=0, keepdim=True)
    return values.gather(0, below_half.clamp_(max=stacked.shape[0] - 1)).squeeze(0)


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float], tau: float, n_iters: int) -> torch.Tensor:
    """CenteredClip: v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i with clip(z, tau) = z min(1, tau / ||z||),
    `n_iters` times from the weighted coordinate median (stops early once v moves by less than 1e-6 tau).

    No copy weighs more than the median copy (the lower one for an even count): a peer's weight is the samples it
    says it accumulated, which a Byzantine peer can inflate up to what it reports, or reach honestly by being the
    fastest in a round. With half the total weight it would be the weighted median of every coordinate where its
    values are extreme, and pull v to itself; capped, a minority of peers never outweighs the others."""
    stacked = torch.stack([part.reshape(-1).float() for part in parts])
    w = torch.tensor(weights, dtype=stacked.dtype)
    w = torch.minimum(w, w.median())
    w = w / w.sum()
    center = weighted_median(stacked, w)
    deltas = torch.empty_like(stacked)
    for _ in range(n_iters):
        torch.sub(stacked, center, out=deltas)
        norms = torch.linalg.vector_norm(deltas, dim=1)
        coefficients = w * (tau / norms.clamp_min(1e-30)).clamp_(max=1.0)
        if not bool(torch.isfinite(norms).all()):  # x_i - v overflowed: that copy's clipped contribution is 0
            deltas[~torch.isfinite(norms)] = 0.0
        step = coefficients @ deltas
        center += step
        if float(step.norm()) <= 1e-6 * tau:
            break
    return center.reshape(parts[0].shape).to(parts[0].dtype)


def aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], aggregation: Aggregation = MEAN) -> torch.Tensor:
    """The aggregate of usable copies of one part (finite values, weights finite and >= 0, positive total weight)."""
    if aggregation.name == "centered_clip" and len(parts) > 1:
        return centered_clip(parts, weights, aggregation.tau, aggregation.n_iters)
    return weighted_mean(parts, weights)


def rejection_reason(part: torch.Tensor, weight: float, shape: torch.Size) -> str | None:
    """Why a received copy of a part must not be aggregated, or None if it may."""
    if not (weight >= 0 and weight != float("inf")):  # also catches NaN
        return f"invalid weight {weight!r}"
    if part.shape != shape:
        return f"shape {tuple(part.shape)} instead of {tuple(shape)}"
    if not math.isfinite(float(part.sum(dtype=torch.float64))):  # one pass; any nan/inf makes the sum non-finite
        return "non-finite values (nan/inf)"
    return None


# --- the reducer --------------------------------------------------------------------------------------------------


class RobustTensorPartReducer(TensorPartReducer):
    """hivemind's reducer, but it buffers every sender's copy of the current part, excludes unusable copies and
    aggregates with `aggregation` once all expected copies arrived. `sender_names` (peer IDs) are used in logs."""

    current_part_index: int
    current_part_accumulated_from: int
    num_current_senders: int
    current_part_future: asyncio.Future

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        *,
        aggregation: Aggregation = MEAN,
        sender_names: Sequence[str] | None = None,
        weight_caps: Sequence[float] | None = None,
    ):
        self.aggregation = aggregation
        self.sender_names = list(sender_names) if sender_names is not None else [str(i) for i in range(num_senders)]
        self.weight_caps = list(weight_caps) if weight_caps is not None else [math.inf] * num_senders
        self.clamped_senders: set[int] = set()
        self.received: list[tuple[torch.Tensor, float]] = []  # usable copies of the current part
        self.excluded_senders: dict[int, str] = {}  # sender index -> why its copies were excluded (this round)
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        """Move on to the next part (hivemind's, without allocating a sum: copies are buffered in self.received)."""
        assert self.current_part_accumulated_from == self.num_current_senders or self.current_part_index == -1
        self.received = []
        if self.current_part_index >= self.num_parts - 1:
            self.finalize()
            return
        self.current_part_index += 1
        self.current_part_accumulated_from = 0
        self.current_part_future = asyncio.Future()
        self.num_current_senders = sum(self.current_part_index < failed for failed in self.sender_failed_after)
        self.accumulator = None

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """Buffer this copy of the part, wait for all other copies, then return the aggregate."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # wait for previous parts to finish processing
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self._receive(sender_index, tensor_part, weight)
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def _receive(self, sender_index: int, part: torch.Tensor, weight: float) -> None:
        reason = rejection_reason(part, weight, self.part_shapes[self.current_part_index])
        cap = self.weight_caps[sender_index]
        if reason is None and weight > cap:
            if sender_index not in self.clamped_senders:
                self.clamped_senders.add(sender_index)
                logger.warning(
                    f"Clamping the weight of peer {self.sender_names[sender_index]} from {weight:g} to {cap:g}: "
                    "more than the samples it reported"
                )
            weight = cap
        if reason is None:
            self.received.append((part, float(weight)))
        elif sender_index not in self.excluded_senders:
            self.excluded_senders[sender_index] = reason
            logger.warning(
                f"Excluding peer {self.sender_names[sender_index]} from this averaging round: it sent {reason} "
                f"(part {self.current_part_index})"
            )

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            self._resolve_current_part()
            self.reset_accumulators()

    def _resolve_current_part(self) -> None:
        usable = [(part, weight) for part, weight in self.received if weight > 0]
        if usable:
            parts, weights = [part for part, _ in usable], [weight for _, weight in usable]
            self.current_part_future.set_result(aggregate(parts, weights, self.aggregation))
        elif self.current_part_accumulated_from == 0:  # nobody waits for it (every sender failed)
            self.current_part_future.set_result(torch.zeros(self.part_shapes[self.current_part_index]))
        else:
            self.current_part_future.set_exception(
                NoUsablePartError(f"no usable copy of part {self.current_part_index}: senders keep their own values")
            )


def _retire(reducer: TensorPartReducer) -> None:
    """Retire a reducer that was never used (it must not warn about parts it never received)."""
    reducer.current_part_future.cancel()
    reducer.finished.set()


# --- the all-reduce runner and the averagers --------------------------------------------------------------------------


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce runner with a RobustTensorPartReducer for the part this peer reduces."""

    def __init__(
        self, *, aggregation: Aggregation = MEAN, weight_caps: dict[PeerID, float] | None = None, **kwargs: Any
    ):
        super().__init__(**kwargs)
        _retire(self.tensor_part_reducer)
        caps = weight_caps or {}
        self.tensor_part_reducer: TensorPartReducer = RobustTensorPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(self.sender_peer_ids),
            aggregation=aggregation,
            sender_names=[peer.to_base58() for peer in self.sender_peer_ids],
            weight_caps=[caps.get(peer, math.inf) for peer in self.sender_peer_ids],
        )

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        if peer_id != self.peer_id:
            return await self._exchange_with_reducer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            try:
                averaged_part = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=self.weight
                )
                delta = averaged_part - tensor_part
            except NoUsablePartError:
                delta = torch.zeros_like(tensor_part)  # keep the local values of a part nobody could aggregate
            self.tensor_part_container.register_processed_part(peer_index, part_index, delta)

    async def _exchange_with_reducer(self, peer_id: Any) -> None:
        """Send our copy of the part `peer_id` reduces, receive the aggregate; then close the stream ourselves.

        hivemind 1.1.12 reads until the reducer closes the stream. But when a reducer's handler returns, the stream
        is reset (p2pd logs "stream reset" some 50 ms later), and on a busy CPU the parts still in flight were lost:
        this peer got only k of n parts, without an error, and the round was partial (2 rounds in 400 between two
        processes beside 3 busy ones, benchmarks/stream_end.py; 0 in 400 with this). Here the
        receiving side, which knows how many parts to expect, closes the stream once it has them all; the reducer
        (`rpc_aggregate_part` below) waits for that.
        """
        peer_index = self.ordered_peer_ids.index(peer_id)
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        received = 0

        def deserialize(message: averaging_pb2.AveragingData) -> torch.Tensor:
            if message.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
            return deserialize_torch_tensor(message.tensor_part)

        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            results = amap_in_executor(
                deserialize,
                aiter_with_timeout(stream, self.reducer_timeout),
                max_prefetch=self.tensor_part_container.prefetch,
            )
            try:
                async for delta in results:
                    self.tensor_part_container.register_processed_part(peer_index, received, delta)
                    received += 1
                    if received == expected:
                        break
            finally:
                await results.aclose()
                await stream.aclose()  # closes our end: the reducer's handler ends when it sees it
            if received != expected:
                raise AllreduceException(f"peer {peer_id} sent {received} parts, but we expected {expected}")
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug(f"Caught {e!r} when communicating to {peer_id}", exc_info=True)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def rpc_aggregate_part(self, stream: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        """hivemind's handler, then: wait for the sender to close the stream (it does once it has every part, see
        `_exchange_with_reducer`) rather than return, which would let p2pd reset the stream under the sender's
        unread parts. The wait is bounded (a sender that never closes costs it reducer_timeout, 10 s by default)."""
        async for message in super().rpc_aggregate_part(stream, context):
            yield message
        await asyncio.sleep(self.reducer_timeout or 10.0)  # cancelled as soon as the sender closes the stream


async def run_robust_allreduce_(
    averager: Any,
    aggregation: Aggregation,
    tensors: Sequence[torch.Tensor],
    group_info: Any,
    group_id: bytes | None = None,
    runner_cls: type[RobustAllReduceRunner] | None = None,
    **kwargs: Any,
) -> None:
    """hivemind's DecentralizedAverager._run_allreduce_inplace_ with a RobustAllReduceRunner (or `runner_cls`), and
    the group's averaging modes (hivemind 1.1.12 reads them from the group, then does not pass them on: an auxiliary
    peer then runs as a sender of zeros, weight 0, and receives the averaged values)."""
    group_id = group_info.group_id if group_id is None else group_id
    kwargs.setdefault("modes", group_modes(averager, group_info))
    runner = (runner_cls or RobustAllReduceRunner)(
        aggregation=aggregation,
        p2p=averager._p2p,
        servicer_type=type(averager),
        prefix=averager.prefix,
        tensors=tensors,
        group_id=group_id,
        ordered_peer_ids=group_info.peer_ids,
        **kwargs,
    )
    assert group_id in averager._running_groups, f"group {group_id!r} was not registered"
    averager._running_groups[group_id].set_result(runner)
    if runner.modes[group_info.peer_ids.index(averager.peer_id)] == AveragingMode.AUX:
        async for _ in runner:
            raise ValueError("aux peers should not receive averaged tensors")
        return
    updates: AsyncIterator = azip(as_aiter(*tensors), runner)
    async for tensor, update in updates:
        tensor.add_(update, alpha=averager._averaging_alpha)
        averager.last_updated = get_dht_time()
        averager._state_updated.set()


def group_modes(averager: Any, group_info: Any) -> tuple[AveragingMode, ...]:
    """Each group member's averaging mode (node, client, auxiliary), from the data gathered at matchmaking."""
    return tuple(AveragingMode(averager.serializer.loads(data)[1]) for data in group_info.gathered)


def reported_sample_caps(records: Any, peers: Sequence[PeerID], now: float) -> dict[PeerID, float]:
    """The most each peer of a group may weigh in a gradient round, from the swarm's progress records (hivemind's
    `{run_id}_progress`: samples accumulated, samples/s, time): WEIGHT_SLACK x (reported samples, extrapolated at the
    reported rate for at most MAX_EXTRAPOLATION_S) + 1. A peer without a record gets the smallest cap of the others;
    several records naming one peer count as the largest (a forged record cannot lower another peer's cap)."""
    reported: dict[bytes, float] = {}
    entries = records.items() if isinstance(records, dict) else ()
    for _, entry in entries:
        value = entry.value if isinstance(entry, ValueWithExpiration) else None
        if not isinstance(value, dict) or not isinstance(value.get("peer_id"), bytes):
            continue
        fields = [value.get(name) for name in ("samples_accumulated", "samples_per_second", "time")]
        if not all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in fields
        ):
            continue
        samples, rate, at = (float(x) for x in fields)  # type: ignore[arg-type]
        elapsed = min(max(now - at, 0.0), MAX_EXTRAPOLATION_S)
        estimate = samples + rate * elapsed
        reported[value["peer_id"]] = max(reported.get(value["peer_id"], 0.0), estimate)
    caps = {peer: WEIGHT_SLACK * reported[peer.to_bytes()] + 1 for peer in peers if peer.to_bytes() in reported}
    if not caps:
        return {}
    smallest = min(caps.values())
    return {peer: caps.get(peer, smallest) for peer in peers}


EPOCH_KEY_BITS = 16  # matchmaking keys carry the collaborative step modulo 2**EPOCH_KEY_BITS


def epoch_group_bits(epoch: int) -> str:
    """hivemind's group bits that key matchmaking by collaborative step (see EpochKeyedMatchmaking)."""
    return format(epoch % 2**EPOCH_KEY_BITS, f"0{EPOCH_KEY_BITS}b")


class EpochKeyedMatchmaking(DecentralizedAverager):
    """Rounds for different collaborative steps never meet: hivemind 1.1.12 matches every peer that looks for a group
    under one key, so a peer still at step k could join a group of peers already at step k+1 and average its step-k
    gradients into theirs (seen with transformers' run_clm.py and 2 peers: weights differed by 6e-3 after 8 steps).
    The owner sets `round_epoch` before a round is scheduled; the group bits of the matchmaking key then carry it."""

    round_epoch: int | None = None

    def schedule_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.round_epoch is not None:  # through the averager's pipe, so it lands before the step below
            self.set_group_bits(epoch_group_bits(self.round_epoch), wait=False)
        return super().schedule_step(*args, **kwargs)


class RobustGradientAverager(EpochKeyedMatchmaking, GradientAverager):
    """hivemind's GradientAverager whose all-reduce excludes garbage and aggregates with `aggregation`. Given the
    swarm's `progress_key`, each sender's weight (its accumulated samples) is clamped to what it reported there.

    A failed round falls back to this peer's own gradients. In hivemind 1.1.12 `step(reset_accumulators=True)` loads
    the accumulators into the averaged tensors and zeroes them before the all-reduce; when the round then fails,
    hivemind.Optimizer ("Proceeding with local gradients") loads the zeroed accumulators again, scaled by 1/0 -> 0.0,
    and the optimizer steps with zero gradients (two peers that could not reach each other trained 4 steps and their
    parameters never moved). Here the averaged tensors, which still hold this peer's gradients (or, after a round that
    broke midway, its gradients with the parts that were averaged), are kept instead."""

    def __init__(self, *args: Any, aggregation: Aggregation = MEAN, progress_key: str | None = None, **kwargs: Any):
        self.aggregation = aggregation  # set before the averager process forks
        self.progress_key = progress_key
        self._holds_local_gradients = False  # the averaged tensors hold the gradients of the round just begun
        self._in_step = False
        super().__init__(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_step = True
        try:
            return super().step(*args, **kwargs)
        finally:
            self._in_step = False

    def reset_accumulated_grads_(self) -> None:
        super().reset_accumulated_grads_()
        self._holds_local_gradients = self._in_step  # zeroed by step(): the averaged tensors hold them now

    def load_accumulators_into_averager_(self) -> None:
        if self.local_times_accumulated == 0 and self._holds_local_gradients:
            return  # a failed round: the averaged tensors already hold this peer's gradients
        super().load_accumulators_into_averager_()

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any, **kwargs: Any) -> None:
        caps = await self._weight_caps(group_info.peer_ids)
        await run_robust_allreduce_(self, self.aggregation, tensors, group_info, weight_caps=caps, **kwargs)

    async def _weight_caps(self, peers: Sequence[PeerID]) -> dict[PeerID, float] | None:
        if self.progress_key is None:
            return None
        try:
            found = await asyncio.wait_for(
                self.dht.get(self.progress_key, latest=True, return_future=True),
                timeout=CAPS_FETCH_TIMEOUT_S,
            )
        except Exception as e:  # a slow DHT must not stall the round: it runs unclamped, and says so
            logger.warning(f"Could not read the swarm's progress to check averaging weights ({e!r})")
            return None
        return reported_sample_caps(found.value if found is not None else {}, peers, get_dht_time())

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # hivemind names RPCs after the class: keep hivemind's names so that subclasses and plain peers interoperate
        return GradientAverager._get_handle_name(namespace, method_name)


def state_rejection_reason(
    metadata: Any, tensors: Sequence[torch.Tensor], expected: Sequence[tuple] | None
) -> str | None:
    """Why a downloaded state (hivemind's `(metadata, tensors)`) must not be loaded, or None if it may be."""
    if not isinstance(metadata, dict):
        return f"metadata is a {type(metadata).__name__}, not a dict"
    epoch = metadata.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        return f"epoch {epoch!r} is not a non-negative integer"
    if expected is not None and len(tensors) != len(expected):
        return f"{len(tensors)} tensors where this model has {len(expected)}"
    for index, tensor in enumerate(tensors):
        if expected is not None and tuple(tensor.shape) != tuple(expected[index]):
            return f"tensor {index} has shape {tuple(tensor.shape)}, expected {tuple(expected[index])}"
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"tensor {index} holds non-finite values"
    return None


class CheckedStateDownload(DecentralizedAverager):
    """A state download (`load_state_from_peers`) that checks what each peer served before anyone loads it, and asks
    the next peer (by priority) when a state fails the checks: one broken or malicious peer cannot hand out NaN
    weights or a model of another shape. Subclasses say what to expect in `_expected_state_shapes`."""

    def _expected_state_shapes(self) -> list[tuple] | None:
        return None  # no expectation on shapes: only the generic checks

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None) -> Any:
        if not wait:
            raise ValueError("trahiv's checked state download is synchronous: call it with wait=True")
        expected = self._expected_state_shapes()
        rejected: list[str] = []
        for _ in range(MAX_STATE_SOURCES):
            future: MPFuture = MPFuture()
            self._outer_pipe.send(("_load_state_from_peers", [], dict(timeout=timeout, future=future, skip=rejected)))
            loaded = future.result(timeout=timeout)
            if loaded is None:
                return None
            metadata, tensors, peer = loaded
            reason = state_rejection_reason(metadata, tensors, expected)
            if reason is None:
                return metadata, tensors
            logger.warning(f"Rejected the state served by peer {peer}: {reason}")
            rejected.append(peer)
        logger.warning(f"No usable state among the {len(rejected)} peers asked: keeping the local state")
        return None

    async def _load_state_from_peers(  # type: ignore[override]
        self, future: MPFuture, timeout: float | None = None, skip: Sequence[str] = ()
    ) -> None:
        """In the averager process: download the state of the highest-priority peer not in `skip`; the result is
        `(metadata, tensors, peer_id)` or None. Decoding goes through hivemind's tensor deserializer (no pickle)."""
        chunk_timeout = None if timeout is None else (self.next_chunk_timeout or self.request_timeout)
        try:
            key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
            found = self.dht.get(key, latest=True)
            declared = found.value if found is not None and isinstance(found.value, dict) else {}
            priority = {
                PeerID(peer): (float(info.value), random.random())
                for peer, info in declared.items()
                if isinstance(info, ValueWithExpiration) and isinstance(info.value, float | int)
            }
            for peer in sorted(priority, key=priority.__getitem__, reverse=True):
                if peer == self.peer_id or str(peer) in skip:
                    continue
                try:
                    state = await self._download_state_from(peer, chunk_timeout)
                except Exception as e:
                    logger.warning(f"Failed to download the state from {peer}: {e!r}")
                    continue
                if state is not None:
                    future.set_result((*state, str(peer)))
                    return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_state_from(self, peer: PeerID, timeout: float | None) -> tuple[Any, list[torch.Tensor]] | None:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata: Any = None
        tensors: list[torch.Tensor] = []
        parts: list[Any] = []
        async for message in aiter_with_timeout(stream, timeout=timeout):
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a dtype marks the first chunk of the next tensor
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return (metadata, tensors) if metadata else None


class RobustTrainingStateAverager(EpochKeyedMatchmaking, TrainingStateAverager, CheckedStateDownload):
    """hivemind's TrainingStateAverager (parameters, optimizer statistics) whose all-reduce excludes garbage and whose
    state download is checked against this model's parameters and optimizer statistics."""

    def __init__(self, *args: Any, aggregation: Aggregation = MEAN, **kwargs: Any):
        self.aggregation = aggregation
        super().__init__(*args, **kwargs)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any, **kwargs: Any) -> None:
        caps = {peer: 1.0 for peer in group_info.peer_ids}  # every peer weighs 1 in state averaging (hivemind's)
        await run_robust_allreduce_(self, self.aggregation, tensors, group_info, weight_caps=caps, **kwargs)

    def _expected_state_shapes(self) -> list[tuple] | None:
        with torch.no_grad(), self.lock_averaged_tensors:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            _, optimizer_tensors = dump_optimizer_state(self.optimizer)
            return [tuple(t.shape) for t in (*params, *self.extra_tensors, *optimizer_tensors)]

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return TrainingStateAverager._get_handle_name(namespace, method_name)
