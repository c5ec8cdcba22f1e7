"""Encode and decode time of the averaging codecs, per call, for one tensor (or all-reduce part) of N values.

Prints JSON. Run:
    .venv/bin/python benchmarks/codecs.py --sizes 65536 524288 --threads 1 2

`uniform8bit (hivemind)` is the engine's own encoder, which a reducer uses for the aggregates it returns (the wire
codec named in the message: `hivemind.compression.serialize_torch_tensor`); `uniform8bit (trahiv)` is
trahiv.compression.FastUniform8BitQuantization, which a sender uses for its parts (`make_compression`). CPU seconds
count every thread of this process (torch's own threads included). The machine's load average is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from trahiv import engine
from trahiv.compression import make_compression


def codecs() -> dict[str, Any]:
    def stock(kind: int) -> Any:
        return lambda tensor, info: serialize_torch_tensor(tensor, kind, info)

    return {
        "fp16": make_compression("fp16").compress,
        "uniform8bit (hivemind)": stock(runtime_pb2.CompressionType.UNIFORM_8BIT),
        "uniform8bit (trahiv)": make_compression("uniform8bit").compress,
        "blockwise8bit": make_compression("blockwise8bit").compress,
    }


def timed(call: Any, repeats: int) -> tuple[float, float]:
    for _ in range(3):  # warm-up
        call()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - wall) / repeats, (time.process_time() - cpu) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[65536, 524288])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch.set_num_threads for each pass")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # torch deprecates quantize_per_tensor, which both 8-bit encoders use
    engine.apply()
    load_before = os.getloadavg()
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for size in args.sizes:
            tensor = torch.randn(size, generator=torch.Generator().manual_seed(0))
            info = CompressionInfo.from_tensor(tensor, key=0)
            for name, compress in codecs().items():
                message = compress(tensor, info)
                encode = timed(lambda c=compress, t=tensor, i=info: c(t, i), args.repeats)
                decode = timed(lambda m=message: deserialize_torch_tensor(m), args.repeats)
                rows.append({
                    "codec": name, "values": size, "torch_threads": threads,
                    "encode_ms": round(encode[0] * 1e3, 3), "encode_cpu_ms": round(encode[1] * 1e3, 3),
                    "decode_ms": round(decode[0] * 1e3, 3), "decode_cpu_ms": round(decode[1] * 1e3, 3),
                    "encode_ns_per_value": round(encode[0] / size * 1e9, 2),
                })  # fmt: skip
    print(json.dumps({
        "benchmark": "codecs", "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "results": rows,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
