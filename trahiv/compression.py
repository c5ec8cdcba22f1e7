"""Compression of averaged tensors, chosen by name in `hivemind_config["opt"]`."""

from __future__ import annotations

from hivemind.compression import (
    BlockwiseQuantization,
    CompressionBase,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    Uniform8BitQuantization,
)

from trahiv.config import COMPRESSIONS

__all__ = ["SIZE_ADAPTIVE_THRESHOLD", "make_compression"]

# "Training Transformers Together": 8-bit for tensors with at least 2^16 elements, 16-bit below.
SIZE_ADAPTIVE_THRESHOLD = 2**16


def make_compression(name: str) -> CompressionBase:
    """The engine's compression for one of `trahiv.config.COMPRESSIONS`."""
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
    return factories[name]()
