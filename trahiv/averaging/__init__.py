"""Averaging that peers sending garbage cannot break: see `trahiv.averaging.robust`."""

from trahiv.averaging.robust import (
    Aggregation,
    RobustAllReduceRunner,
    RobustGradientAverager,
    RobustTensorPartReducer,
    RobustTrainingStateAverager,
    aggregate,
    centered_clip,
)

__all__ = [
    "Aggregation",
    "RobustAllReduceRunner",
    "RobustGradientAverager",
    "RobustTensorPartReducer",
    "RobustTrainingStateAverager",
    "aggregate",
    "centered_clip",
]
