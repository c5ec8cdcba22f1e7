"""Small tensors averaged as one: the all-reduce's tensors when a round averages many small ones (LoRA adapters).

hivemind 1.1.12 cuts each tensor into parts of at most `part_size_bytes` (a part never spans two tensors) and deals
the parts out to the group's peers. A tensor smaller than a part is a part of its own: 128 LoRA tensors of 65,536
values made 128 parts of 256 KiB (fp32), each with its own serialization, stream message, reduction and
bookkeeping in Python. 4 peers' 8-bit rounds took 1.69x the bandwidth bound as 128 tensors and 1.46x as 16
(benchmarks/averaging_round.py, stop 36). Here the tensors smaller than a part are concatenated into one flat tensor
per dtype (and compression role), averaged as one, and copied back. Every peer plans from the same shapes, dtypes
and settings, so every peer of a group averages the same tensors: the plan depends on nothing else.

Only codecs that treat values one by one take part (`none`, `fp16`), so a value averages to the same result
whichever tensors share its part. `scaled_fp16` and the 8-bit codecs scale a part as a whole: tensors of different
magnitudes in one part would lose the smaller ones' precision, so their tensors are averaged as before."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.utils.tensor_descr import TensorDescriptor

__all__ = ["Buckets", "plan_buckets"]

DEFAULT_PART_SIZE_BYTES = 2**19  # hivemind's


def _per_value(compression: CompressionBase | None) -> bool:
    """Whether `compression` encodes each value alone (a value's result does not depend on its part)."""
    inner = getattr(compression, "inner", compression)  # trahiv.compression.FloatsOnly
    return compression is None or type(inner) in (NoCompression, Float16Compression)  # (not ScaledFloat16: per part)


def plan_buckets(
    tensors: Sequence[torch.Tensor],
    group_size: int,
    *,
    compression: CompressionBase | None = None,
    part_size_bytes: int | None = None,
    tensor_infos: Sequence[CompressionInfo] | None = None,
) -> list[list[int]]:
    """The round's tensors as lists of indices into `tensors`: one index, a tensor averaged as it is; several, the
    tensors concatenated (in this order) into one. Each bucket takes the place of its first tensor."""
    if group_size < 2 or not _per_value(compression):
        return [[i] for i in range(len(tensors))]
    limit = part_size_bytes or DEFAULT_PART_SIZE_BYTES  # a smaller tensor would be a part of its own
    plan: list[list[int]] = []
    open_buckets: dict[tuple, list[int]] = {}
    for i, tensor in enumerate(tensors):
        if tensor.is_floating_point() and tensor.numel() * tensor.element_size() < limit:
            role = tensor_infos[i].role if tensor_infos is not None else None
            key = (tensor.dtype, tensor.device, role)
            if key not in open_buckets:
                open_buckets[key] = []
                plan.append(open_buckets[key])
            open_buckets[key].append(i)
        else:
            plan.append([i])
    return plan


@dataclass
class Buckets:
    """The round's tensors for `plan` (views of the originals for single tensors, new flat tensors for buckets);
    `write_back()` copies the buckets' results into the original tensors."""

    originals: Sequence[torch.Tensor]
    plan: list[list[int]]
    tensors: list[torch.Tensor]
    tensor_infos: list[CompressionInfo] | None

    @classmethod
    def make(
        cls,
        tensors: Sequence[torch.Tensor],
        group_size: int,
        *,
        compression: CompressionBase | None = None,
        part_size_bytes: int | None = None,
        tensor_infos: Sequence[CompressionInfo] | None = None,
    ) -> Buckets:
        plan = plan_buckets(
            tensors, group_size, compression=compression, part_size_bytes=part_size_bytes, tensor_infos=tensor_infos
        )
        merged: list[torch.Tensor] = []
        infos: list[CompressionInfo] | None = [] if tensor_infos is not None else None
        for indices in plan:
            if len(indices) == 1:
                merged.append(tensors[indices[0]])
            else:
                merged.append(torch.cat([tensors[i].detach().reshape(-1) for i in indices]))
            if infos is not None and tensor_infos is not None:
                first = tensor_infos[indices[0]]
                descriptor = first.descriptor if len(indices) == 1 else TensorDescriptor.from_tensor(merged[-1])
                infos.append(CompressionInfo(first.key, descriptor, first.role))
        return cls(tensors, plan, merged, infos)

    @property
    def bucketed(self) -> bool:
        return len(self.tensors) < len(self.originals)

    @torch.no_grad()
    def write_back(self) -> None:
        for indices, merged in zip(self.plan, self.tensors, strict=True):
            if len(indices) == 1:
                continue  # averaged in place
            offset = 0
            for i in indices:
                original = self.originals[i]
                original.copy_(merged[offset : offset + original.numel()].view_as(original))
                offset += original.numel()
