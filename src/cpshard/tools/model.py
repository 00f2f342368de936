"""The model ``cpshard verify`` trains, and what its hybrid variant shares with it: the sizes, the
batch, RMSNorm, the rotary embedding and the transformer block (Note [How verify's ranks add up to
cp = 1] in ``verify.py``). Plain PyTorch; no communication of its own (attention comes in as a
function).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DTYPES", "Block", "TinyDecoder", "rotary"]

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
VOCAB, HIDDEN, HEADS, LAYERS, MTP_DEPTHS, MTP_SCALE = 61, 32, 4, 2, 2, 0.3


def token_batch(lengths: Sequence[int]) -> list[torch.Tensor]:
    """The token ids ``verify`` runs on: one ``(n,)`` int64 tensor per length, the same on every rank (seed 1)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


# -- the model --------------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``(R, H, D)`` at ``positions`` ``(R,)`` (pairs ``(2i, 2i + 1)`` rotated)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=x.dtype, device=x.device) / dim))
    angles = positions.to(x.dtype)[:, None, None] * inv_freq  # (R, 1, D / 2)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Mix = Callable[[int, torch.Tensor], torch.Tensor]


class Block(nn.Module):
    """Pre-norm transformer layer: rotary causal attention (by the plan) and a SiLU MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.Parameter(torch.ones(hidden))
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """``x`` ``(R, hidden)``, ``positions`` ``(R,)`` -> ``(R, hidden)``."""
        q, k, v = self.qkv(_rms_norm(x, self.norm1)).view(x.shape[0], 3, self.heads, -1).unbind(1)
        x = x + self.proj(attend(rotary(q, positions), rotary(k, positions), v).flatten(1))
        return x + self.down(F.silu(self.up(_rms_norm(x, self.norm2))))


class TinyDecoder(nn.Module):
    """Embedding, ``LAYERS`` blocks, and ``MTP_DEPTHS`` multi-token-prediction depths in Megatron's
    shape (depth ``d``: a block over ``proj(cat(norm(h_{d-1}), norm(embed(ids shifted by d))))``),
    sharing the output layer. Deterministic initialisation (seed 0)."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        gen = torch.random.fork_rng(devices=[])
        with gen:
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.layers = nn.ModuleList(Block(HIDDEN, HEADS) for _ in range(LAYERS))
            self.mtp_in = nn.ModuleList(nn.Linear(2 * HIDDEN, HIDDEN, bias=False) for _ in range(MTP_DEPTHS))
            self.mtp_layers = nn.ModuleList(Block(HIDDEN, HEADS) for _ in range(MTP_DEPTHS))
            self.final_norm = nn.Parameter(torch.ones(HIDDEN))
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.to(dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``(R, hidden)`` -> ``(R, VOCAB)``: the output layer every depth shares."""
        return self.head(_rms_norm(h, self.final_norm))

    def hidden(self, ids: torch.Tensor, shifted_ids: torch.Tensor, positions: torch.Tensor,
               attend: Attend, mix: Mix | None = None) -> list[torch.Tensor]:
        """``ids`` ``(R,)``, ``shifted_ids`` ``(MTP_DEPTHS, R)`` -> ``1 + MTP_DEPTHS`` chunks ``(R, hidden)``.
        ``mix(i, h)``, when given, runs after layer ``i`` of the main stack (the hybrid model's linear blocks)."""
        h = self.embed(ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, attend)
            if mix is not None:
                h = mix(i, h)
        chunks = [h]
        for d, (proj, layer) in enumerate(zip(self.mtp_in, self.mtp_layers)):
            mixed = proj(torch.cat([_rms_norm(h, 1.0), _rms_norm(self.embed(shifted_ids[d]), 1.0)], -1))
            h = layer(mixed, positions, attend)
            chunks.append(h)
        return chunks
