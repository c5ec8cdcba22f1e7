"""Compression of averaged tensors, chosen by name in `hivemind_config["opt"]`."""

from __future__ import annotations

import math

import numpy as np
import torch
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
)
from hivemind.proto import runtime_pb2

from trahiv.config import COMPRESSIONS

__all__ = ["SIZE_ADAPTIVE_THRESHOLD", "FastUniform8BitQuantization", "FloatsOnly", "make_compression"]

# "Training Transformers Together": 8-bit for tensors with at least 2^16 elements, 16-bit below.
SIZE_ADAPTIVE_THRESHOLD = 2**16


class FloatsOnly(CompressionBase):
    """Compress floating-point tensors with `inner`; send the rest (e.g. 8-bit optimizer states, step counters)
    as they are: the engine's lossy codecs reject or corrupt integer tensors."""

    def __init__(self, inner: CompressionBase):
        self.inner, self.plain = inner, NoCompression()

    def _codec(self, dtype) -> CompressionBase:
        return self.inner if dtype.is_floating_point else self.plain

    def compress(self, tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return self._codec(tensor.dtype).compress(tensor, info, allow_inplace)

    def extract(self, serialized_tensor: runtime_pb2.Tensor):
        return deserialize_torch_tensor(serialized_tensor)  # dispatches on the codec named in the message

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self._codec(info.descriptor.dtype).estimate_compression_ratio(info)


class FastUniform8BitQuantization(Uniform8BitQuantization):
    """hivemind's uniform 8-bit quantization in the same wire format (any hivemind peer decodes it), encoded with less
    CPU: the codebook holds the bin centres, and the two edge bins the mean of the values clamped into them. hivemind
    averages the values of every bin (a scatter over all values); for the values inside the range (6 sigma wide) the
    centre is within half a bin of that average. The bins are computed with float operations rather than
    `torch.quantize_per_tensor` (deprecated), and the edge bins with numpy: torch's comparison of a uint8 tensor and
    its boolean selection took 0.25 ms per edge for a 65,536-value part, half the encoder's time
    (`benchmarks/codecs.py`)."""

    def quantize(self, tensor: torch.Tensor, allow_inplace: bool = False) -> tuple[np.ndarray, np.ndarray]:
        flat = tensor.detach().to(dtype=torch.float32).reshape(-1)
        shift = flat.mean()
        centered = flat - shift
        scale = self.RANGE_IN_SIGMAS * float(centered.norm()) / math.sqrt(max(flat.numel() - 1, 1)) / self.n_bins
        if not (math.isfinite(scale) and scale > 0):  # constant or non-finite tensors: hivemind's own encoder
            return super().quantize(tensor, allow_inplace)
        offset = self.n_bins // 2
        # round half to even, as quantize_per_tensor does; centered is this function's own tensor
        quantized = centered.div_(scale).round_().add_(offset).clamp_(0, self.n_bins - 1).to(torch.uint8)
        codebook = (torch.arange(self.n_bins, dtype=torch.float32) - offset) * scale + shift
        indices, values = quantized.numpy(), flat.numpy()
        for edge in (0, self.n_bins - 1):
            clamped = values[indices == edge]
            if clamped.size:
                codebook[edge] = float(clamped.mean())
        # a centre outside [min, max] is never nearer to a value than the bound: clamping keeps non-negative tensors
        # non-negative (Adam's exp_avg_sq in a state download: a negative decoded value makes sqrt() NaN)
        low, high = torch.aminmax(flat)
        codebook.clamp_(float(low), float(high))
        return indices.astype(self.indices_dtype, copy=False), codebook.numpy()


def _blockwise_quantization() -> BlockwiseQuantization:
    """hivemind's blockwise 8-bit codec, with bitsandbytes imported now. hivemind imports it at the codec's first use:
    inside the averager process, during its first round (2.8 s on an idle 2-core machine, more under load), which the
    round's deadlines do not allow for: a 2-peer round under another test's load came out partial
    (tests/test_bf16_rounds.py). Imported here, before the averagers start, they inherit it; and a missing bitsandbytes
    is one message at start-up, not a failed round."""
    try:
        import bitsandbytes.functional  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"compression 'blockwise8bit' needs bitsandbytes ({e}): `pip install bitsandbytes`, or use 'uniform8bit'"
        ) from e
    return BlockwiseQuantization()


def make_compression(name: str) -> CompressionBase:
    """The engine's compression for one of `trahiv.config.COMPRESSIONS` (integer tensors go uncompressed)."""
    factories = {
        "none": NoCompression,
        "fp16": Float16Compression,
        "scaled_fp16": ScaledFloat16Compression,
        "uniform8bit": FastUniform8BitQuantization,
        "quantile8bit": Quantile8BitQuantization,
        "blockwise8bit": _blockwise_quantization,
        "size_adaptive": lambda: SizeAdaptiveCompression(
            threshold=SIZE_ADAPTIVE_THRESHOLD, less=Float16Compression(), greater_equal=FastUniform8BitQuantization()
        ),
    }
    if name not in factories:
        raise ValueError(f"unknown compression {name!r}; valid: {', '.join(COMPRESSIONS)}")
    return FloatsOnly(factories[name]())
