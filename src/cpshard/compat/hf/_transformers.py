"""The only module naming transformers' objects (checked against 5.10.4): the ``"cpshard"`` attention in
``AttentionInterface`` and its mask function in ``AttentionMaskInterface``.

The mask function builds nothing: the documents' causal mask comes from the plan, so transformers never
builds a dense ``S x S`` mask for ``"cpshard"``. It refuses a padding mask that masks a token (a 2-D
``attention_mask`` with a zero): under the padding-free format the documents come from the position ids,
and dropping such a mask silently would train on rows the caller meant to hide.
"""

from __future__ import annotations

from typing import Any

from cpshard.base.errors import fail
from cpshard.compat.hf._attention import attention_forward

__all__ = ["NAME", "TESTED_TRANSFORMERS", "register"]

NAME = "cpshard"
TESTED_TRANSFORMERS = "5.10.4"


def _no_mask(*args: Any, attention_mask: Any = None, config: Any = None, use_vmap: bool = False,
             **kwargs: Any) -> None:
    """transformers' mask interface for ``"cpshard"``: no mask (the plan is the mask). Refuses what the plan
    cannot say: chunked attention (``attention_chunk_size``, Llama 4) and a mask overlay the model adds to
    its causal mask (``and_mask_function`` / ``or_mask_function``, e.g. Gemma 3's bidirectional image
    tokens: transformers then asks for ``use_vmap``)."""
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk:
        fail("attention_chunk_size", repr(chunk), "chunked attention is not supported by the 'cpshard' attention "
             "(its mask is the documents' causal one, with the layer's sliding window)",
             "train this model with another attention, or without chunked layers")
    if use_vmap:
        fail("attn_implementation", "'cpshard'", "cannot add the mask overlay this model puts on its causal mask "
             "(an and_mask_function / or_mask_function, e.g. bidirectional image tokens)",
             "train this model with another attention")
    if attention_mask is not None and not bool(attention_mask.all()):
        fail("attention_mask", f"a padding mask of shape {tuple(attention_mask.shape)} with masked tokens",
             "is not read by the 'cpshard' attention (the packed documents come from position_ids)",
             "drop the padding rows from the packed row, or pass no attention_mask")
    return None


def register() -> None:
    """Register ``"cpshard"`` with transformers (idempotent). ``ImportError`` naming the fix where
    transformers lacks the interfaces (before 5.x)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(f"cpshard.compat.hf needs transformers >= 5 (tested on {TESTED_TRANSFORMERS}): its "
                          "AttentionInterface and masking_utils.AttentionMaskInterface. Fix: pip install "
                          f"'transformers=={TESTED_TRANSFORMERS}'") from exc
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
