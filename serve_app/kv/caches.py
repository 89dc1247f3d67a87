"""A worker's per-layer KV cache tensors, addressed by the scheduler's block ids."""

from __future__ import annotations

import torch

from serve_app.kv.wire import KVGeometry


class KVCaches:
    def __init__(self) -> None:
        self.layers: dict[str, torch.Tensor] = {}
        self.geometry: KVGeometry | None = None

    def register(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        self.layers = dict(kv_caches)
        self.geometry = KVGeometry.of(self.layers, block_size)

    def read(self, layer: str, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks of one layer (the blocks may be reused after this step)."""
        kv = self.layers[layer]
        return kv.index_select(0, torch.tensor(block_ids, dtype=torch.long, device=kv.device))

    def write(self, layer: str, block_ids: list[int], data: torch.Tensor) -> None:
        kv = self.layers[layer]
        if tuple(data.shape[1:]) != tuple(kv.shape[1:]) or data.shape[0] != len(block_ids) or data.dtype != kv.dtype:
            raise ValueError(
                f"layer {layer}: got {tuple(data.shape)} {data.dtype} for {len(block_ids)} blocks of {tuple(kv.shape[1:])} {kv.dtype}"
            )
        kv.index_copy_(0, torch.tensor(block_ids, dtype=torch.long, device=kv.device), data)
