"""Compression of averaged tensors, chosen by name in `hivemind_config["opt"]`."""

from __future__ import annotations

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

__all__ = ["SIZE_ADAPTIVE_THRESHOLD", "FloatsOnly", "make_compression"]

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


def make_compression(name: str) -> CompressionBase:
    """The engine's compression for one of `trahiv.config.COMPRESSIONS` (integer tensors go uncompressed)."""
    factories = {
        "none": NoCompression,
        "fp16": Float16Compression,
        "scaled_fp16": ScaledFloat16Compression,
        "uniform8bit": Uniform8BitQuantization,
        "quantile8bit": Quantile8BitQuantization,
        "blockwise8bit": BlockwiseQuantization,
        "size_adaptive": lambda: SizeAdaptiveCompression(
            threshold=SIZE_ADAPTIVE_THRESHOLD, less=Float16Compression(), greater_equal=Uniform8BitQuantization()
        ),
    }
    if name not in factories:
        raise ValueError(f"unknown compression {name!r}; valid: {', '.join(COMPRESSIONS)}")
    return FloatsOnly(factories[name]())
