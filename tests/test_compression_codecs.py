"""trahiv's faster uniform 8-bit encoder: hivemind's wire format and error (speed: benchmarks/codecs.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hivemind.compression import CompressionInfo, Uniform8BitQuantization, deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from trahiv import engine
from trahiv.compression import FastUniform8BitQuantization, make_compression
from trahiv.engine.exact import compression_type

engine.apply()


def samples() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "gaussian": torch.randn(2**20, generator=gen),
        "heavy_tailed": torch.randn(2**20, generator=gen) / torch.rand(2**20, generator=gen).clamp_min(1e-3),
        "lora_shaped": torch.randn(4096, 16, generator=gen) * 1e-2 + 3e-3,
        "constant": torch.full((1000,), 0.5),
    }


@pytest.mark.parametrize("kind", ["gaussian", "heavy_tailed", "lora_shaped", "constant"])
def test_fast_uniform8bit_matches_hivemind_error_and_format(kind):
    tensor = samples()[kind]
    info = CompressionInfo.from_tensor(tensor, key=0)
    ours, theirs = (
        FastUniform8BitQuantization().compress(tensor, info),
        Uniform8BitQuantization().compress(tensor, info),
    )
    assert ours.compression == runtime_pb2.UNIFORM_8BIT and len(ours.buffer) == len(theirs.buffer)
    assert int(np.frombuffer(ours.buffer, count=1, dtype=np.int64)[0]) == 256
    ours_error = float((deserialize_torch_tensor(ours) - tensor).norm())
    theirs_error = float((deserialize_torch_tensor(theirs) - tensor).norm())
    assert ours_error <= 1.02 * theirs_error + 1e-7, (ours_error, theirs_error)


@pytest.mark.parametrize("name", ["uniform8bit", "size_adaptive"])
def test_named_8bit_compressions_use_the_fast_encoder(name):
    tensor = torch.randn(2**16)  # at the size-adaptive threshold: 8-bit
    message = make_compression(name).compress(tensor, CompressionInfo.from_tensor(tensor, key=0))
    assert message.compression == runtime_pb2.UNIFORM_8BIT
    centres = np.frombuffer(message.buffer, offset=8, count=256, dtype=np.float32)[1:-1]
    assert np.allclose(np.diff(centres), np.diff(centres)[0], rtol=1e-3)  # bin centres: evenly spaced


def test_reducers_encode_their_results_with_the_fast_encoder():
    """A reducer serializes each aggregate in the codec its sender's message names (hivemind's
    `serialize_torch_tensor(tensor, compression_type)`, also hivemind's own parameter rounds): trahiv's encoder, whose
    codebook holds evenly spaced bin centres (hivemind's holds each bin's mean)."""
    from hivemind.compression import serialize_torch_tensor

    tensor = torch.randn(2**16, generator=torch.Generator().manual_seed(0))
    message = serialize_torch_tensor(tensor, runtime_pb2.UNIFORM_8BIT)
    centres = np.frombuffer(message.buffer, offset=8, count=256, dtype=np.float32)[1:-1]
    assert np.allclose(np.diff(centres), np.diff(centres)[0], rtol=1e-3)
    theirs = Uniform8BitQuantization().compress(tensor, CompressionInfo.from_tensor(tensor))
    hivemind_centres = np.frombuffer(theirs.buffer, offset=8, count=256, dtype=np.float32)[1:-1]
    assert not np.allclose(np.diff(hivemind_centres), np.diff(hivemind_centres)[0], rtol=1e-3)  # the control
    ours_error = float((deserialize_torch_tensor(message) - tensor).norm())
    assert ours_error <= 1.02 * float((deserialize_torch_tensor(theirs) - tensor).norm())


def test_decoded_values_stay_within_the_tensors_range():
    """Adam's exp_avg_sq is non-negative: a decoded negative value (a bin centre below the minimum) makes sqrt() NaN
    after a state download. Seen in 8 of 20 such tensors before the codebook was clamped to [min, max]."""
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        tensor = torch.randn(2**16, generator=gen).pow(2) * torch.rand(2**16, generator=gen).pow(8) * 1e-6
        message = FastUniform8BitQuantization().compress(tensor, CompressionInfo.from_tensor(tensor, key=0))
        decoded = deserialize_torch_tensor(message)
        assert float(decoded.min()) >= float(tensor.min()) and float(decoded.max()) <= float(tensor.max()), seed


@pytest.mark.parametrize("name", ["none", "fp16", "scaled_fp16", "uniform8bit", "quantile8bit", "blockwise8bit",
                                  "size_adaptive"])  # fmt: skip
def test_compression_type_names_the_codec_compress_would_use(name):
    """A reducer serializes an aggregate once in the codec its senders used (trahiv.engine.exact) and needs that codec
    for its own part without encoding the part to find out."""
    compression = make_compression(name)
    for tensor in (torch.randn(100), torch.randn(70_000), torch.arange(5)):  # size_adaptive's two sides; integers
        info = CompressionInfo.from_tensor(tensor, key=0)
        assert compression_type(compression, info) == compression.compress(tensor, info).compression, tensor.shape


def test_blockwise8bit_imports_bitsandbytes_before_any_round(monkeypatch):
    """hivemind imports bitsandbytes at the codec's first use, inside the averager's first round (2.8 s here: a round
    under load came out partial); make_compression imports it at once (in a fresh interpreter, where nothing did
    yet), and a missing one is one message."""
    check = (
        "import sys; from trahiv.compression import make_compression; assert 'bitsandbytes' not in sys.modules; "
        "make_compression('blockwise8bit'); assert 'bitsandbytes.functional' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=120)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)  # as if bitsandbytes were not installed
    with pytest.raises(ImportError, match="compression 'blockwise8bit' needs bitsandbytes.*use 'uniform8bit'"):
        make_compression("blockwise8bit")
