"""PowerSGD gradient averaging (hivemind's `PowerSGDGradientAverager`) with trahiv's checks.

PowerSGD (Vogels et al. 2019) sends low-rank factors of each gradient matrix instead of the matrix: two all-reduce
phases per round (P = M Q, then Q = M^T P), with error feedback. Here both phases run on trahiv's robust reducer with
the mean: copies with non-finite values or invalid weights are excluded, weights are clamped to the samples each peer
reported, rounds have payload-based deadlines and are reported complete / partial / failed (`trahiv.averaging.partial`).
CenteredClip is refused: a robust aggregate of the factors is not a robust aggregate of the gradients.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

from trahiv.averaging.partial import Deadlines, ReportingMixin
from trahiv.averaging.robust import MEAN, Aggregation, RobustGradientAverager, run_robust_allreduce_

__all__ = ["RobustPowerSGDGradientAverager"]


class _RobustPowerSGD(PowerSGDGradientAverager):
    aggregation: Aggregation
    progress_key: str | None
    _weight_caps = RobustGradientAverager._weight_caps

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: Any, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        caps = await self._weight_caps(group_info.peer_ids)
        await run_robust_allreduce_(
            self, self.aggregation, tensors, group_info, group_id=group_id, weight_caps=caps, **kwargs
        )

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return PowerSGDGradientAverager._get_handle_name(namespace, method_name)


class RobustPowerSGDGradientAverager(ReportingMixin, _RobustPowerSGD):
    """PowerSGD gradient averager of rank `averager_rank` on trahiv's robust reducer (mean only), with deadlines and
    round reports (each round is two all-reduce phases, each reported)."""

    def __del__(self) -> None:
        if hasattr(self, "_parent_pid"):  # a refused configuration never became a process
            super().__del__()

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        averager_rank: int,
        *,
        deadlines: Deadlines | None = None,
        aggregation: Aggregation = MEAN,
        progress_key: str | None = None,
        **kwargs: Any,
    ):
        if aggregation.name != "mean":
            raise ValueError(
                f"PowerSGD cannot be combined with aggregation {aggregation.name!r}: it averages low-rank factors of "
                "the gradients, and a robust aggregate of the factors is not a robust aggregate of the gradients"
            )
        if averager_rank < 1:
            raise ValueError(f"PowerSGD needs averager_rank >= 1, got {averager_rank}")
        self.progress_key = progress_key
        self._init_reporting(deadlines if deadlines is not None else Deadlines(), aggregation)
        super().__init__(parameters, averager_rank, **kwargs)
