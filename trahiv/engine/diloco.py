"""The DiLoCo averager (trahiv.diloco): pseudo-gradients all-reduced with trahiv's robust reducer, every peer ending
with the same bits (`trahiv.engine.exact`), and the outer state served for download. Overrides hivemind 1.1.12's
`_run_allreduce_inplace_`, `get_current_state`, `_get_handle_name` and sends commands down the averager's pipe."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.utils.mpfuture import MPFuture

from trahiv.averaging import Aggregation, Deadlines
from trahiv.engine.averagers import (
    CheckedStateDownload,
    EpochKeyedMatchmaking,
    ReportingMixin,
    RobustGradientAverager,
)
from trahiv.engine.exact import ExactAverager, ExactRoundRunner

logger = logging.getLogger("trahiv.diloco")

__all__ = ["DiLoCoAverager", "DiLoCoRoundRunner"]


class DiLoCoRoundRunner(ExactRoundRunner):
    """A sync's all-reduce: a part this peer got no average for (its reducer failed it) is a zero pseudo-gradient,
    not this peer's own. Every peer of the group that missed the same part (a groupmate that left the round: its
    share, for all of them) then takes the same outer step, and they stay identical; with their own values there,
    each took its own, their outer parameters' digests all differed at the next sync point, and all but one dropped
    their next pseudo-gradient to download that one's outer state (seen in `benchmarks/diloco.py`: a peer counted in
    a group as it gave up its search, 28.6% of the values unaveraged, three of four peers downloading)."""

    unaveraged_zero = True


class DiLoCoAverager(ReportingMixin, ExactAverager, EpochKeyedMatchmaking, CheckedStateDownload):
    """Averages the pseudo-gradient buffers with trahiv's robust all-reduce (weights capped at the samples each peer
    reported in its progress record, partial rounds reported), every peer ending with the same bits
    (trahiv.engine.exact), and serves the outer state for download: metadata {"epoch": outer step}, tensors =
    outer parameters + outer momentum (fp32). A sync's group assembles as soon as the peers the optimizer expects
    joined (`expect_peers`, EpochKeyedMatchmaking: those at the outer step or one behind; the optimizer sets the
    group bits per outer step)."""

    runner_cls = DiLoCoRoundRunner

    def __init__(
        self,
        *args: Any,
        progress_key: str,
        deadlines: Deadlines | None = None,
        aggregation: Aggregation | None = None,
        **kwargs: Any,
    ):
        self._init_reporting(deadlines if deadlines is not None else Deadlines(), aggregation or Aggregation())
        self.progress_key = progress_key
        self.state_source: Any = None  # set by its optimizer: what get_current_state serves
        super().__init__(*args, **kwargs)

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: Any, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        caps = await RobustGradientAverager._weight_caps(self, group_info.peer_ids)  # type: ignore[arg-type]
        await super()._run_allreduce_inplace_(tensors, group_info, group_id=group_id, weight_caps=caps, **kwargs)

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Any]:
        """In the training process: the outer state (a consistent copy, taken between outer steps)."""
        source = self.state_source
        if source is None:
            return {"epoch": 0}, [], None
        return source.outer_state()

    def _expected_state_shapes(self) -> list[tuple] | None:
        source = self.state_source
        if source is None:
            return None
        return [tuple(t.shape) for t in (*source.outer_params, *source.momenta)]

    def load_state_from(self, peer: str, timeout: float | None) -> tuple[Any, list[torch.Tensor]] | None:
        """Download the outer state of one given peer (checked as CheckedStateDownload does); None if it failed."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_load_state_from_peer", [], dict(peer=peer, timeout=timeout, future=future)))
        loaded = future.result(timeout=timeout)
        if loaded is None:
            return None
        metadata, tensors = loaded
        reason = self.state_rejection(metadata, tensors)
        if reason is not None:
            logger.warning(f"Rejected the state served by peer {peer}: {reason}")
            return None
        return metadata, tensors

    async def _load_state_from_peer(self, peer: str, future: MPFuture, timeout: float | None = None) -> None:
        try:
            chunk_timeout = None if timeout is None else (self.next_chunk_timeout or self.request_timeout)
            future.set_result(await self._download_state_from(PeerID.from_base58(peer), chunk_timeout))
        except Exception as e:
            logger.warning(f"Failed to download the state from {peer}: {e!r}")
        finally:
            if not future.done():
                future.set_result(None)

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return ExactAverager._get_handle_name(namespace, method_name)
