"""A stand-in for flash-attn's ``flash_attn_varlen_func`` on the CPU (no GPU here): each segment through
PyTorch's SDPA with flash-attn's documented mask, causal aligned to the bottom-right corner (flash-attn >=
2.1) and ``window_size=(left, right)``; key/value heads repeated for grouped-query attention, as flash-attn
reads them. What the ``"flash"`` kernel of ``cpshard.compat.hf`` hands the kernel is checked through it; the
kernel itself is not run."""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), **unused):
    assert dropout_p == 0.0 and causal and not unused
    assert q.dim() == 3 and k.shape == v.shape and q.shape[1] % k.shape[1] == 0
    rep = q.shape[1] // k.shape[1]
    out = []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        nq, nk = b - a, d - c
        assert 0 < nq <= max_seqlen_q and 0 < nk <= max_seqlen_k
        i = torch.arange(nq)[:, None]
        j = torch.arange(nk)[None]
        allowed = j <= i + nk - nq
        if window_size[0] >= 0:
            allowed &= j >= i + nk - nq - window_size[0]
        seg_q = q[a:b].transpose(0, 1)
        seg_k = k[c:d].repeat_interleave(rep, 1).transpose(0, 1)
        seg_v = v[c:d].repeat_interleave(rep, 1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(seg_q, seg_k, seg_v, attn_mask=allowed,
                                                  scale=softmax_scale).transpose(0, 1))
    return torch.cat(out)


def install() -> None:
    """Make ``from flash_attn import flash_attn_varlen_func`` find the stand-in (in this process)."""
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    sys.modules["flash_attn"] = module
