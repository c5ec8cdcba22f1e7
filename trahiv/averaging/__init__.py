"""Averaging policy without the engine: aggregation (mean, CenteredClip, checks on parts and downloaded states) in
`robust`, round reports and payload-based deadlines in `partial`. The averagers that apply them inside hivemind's
all-reduce live behind the engine boundary, in `trahiv.engine.averagers`."""

from trahiv.averaging.partial import Deadlines, RoundReport
from trahiv.averaging.robust import MEAN, Aggregation, aggregate, centered_clip

__all__ = ["MEAN", "Aggregation", "Deadlines", "RoundReport", "aggregate", "centered_clip"]
