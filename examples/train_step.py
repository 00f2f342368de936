"""A whole training step with cpshard on real ranks: ids, labels, loss mask, positions, the token-mean
loss and a multi-token-prediction loss exact under CP, and the per-token log-probs restored per sequence.

Run it: ``python examples/train_step.py`` (2 gloo processes on this machine). It checks that the
loss, every parameter gradient and the restored log-probs equal the single-process step's. The
model is a toy that treats tokens independently (embedding, two MTP heads, the output layer): a real
model also hands its attention kernel ``plan.cu_seqlens_padded`` and ``plan.max_seqlen``.

The gradient convention is cpshard's default, ``grad_reduction="mean"`` (Note [Gradient convention]
in ``cpshard/loss.py``): gradients are averaged over the CP group after backward, as Megatron's
DDP / FSDP and PyTorch's DDP do; ``token_mean`` and ``mtp_loss`` carry the factor ``cp`` for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard import ShardPlan, layout_for, shard
from cpshard.distributed import gather
from cpshard.loss import token_mean
from cpshard.mtp import mtp_loss
from cpshard.spawn import run_ranks

VOCAB, HIDDEN, DEPTHS = 50, 8, 2


class Toy(torch.nn.Module):
    """Embedding, one small head per MTP depth, the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.mtp = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(DEPTHS))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> list[torch.Tensor]:
        hidden = self.embed(ids)
        return [hidden] + [torch.tanh(layer(hidden)) for layer in self.mtp]  # main, then depths 1..N


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Toy().double()


def make_batch() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (37, 5, 120, 1)]


# --- the step (what the README shows) -------------------------------------------------------------
def train_step(model, batch, config, cp_rank, cp_size, cp_group):
    plan = ShardPlan.build([len(s) for s in batch], cp_size=cp_size, tp_size=1, layout=layout_for(config))
    input_ids = shard(batch, plan, cp_rank)                        # (L,) this rank's rows
    labels = shard(batch, plan, cp_rank, shift=1, fill=-100)       # (L,) next token; -100 past the end and on pad
    loss_mask = plan.label_mask(cp_rank, shift=1)                  # (L,) True where a label exists
    position_ids = plan.position_ids(cp_rank)                      # (L,) for RoPE (unused by this toy)

    def per_token_ce(labels, logits):                              # -100 rows give 0
        return F.cross_entropy(logits, labels, reduction="none")

    chunks = model(input_ids)                                      # [(L, H) main, (L, H) per MTP depth]
    mtp = mtp_loss(chunks, labels, loss_mask, plan, cp_group, output_layer=model.head,
                   loss_fn=per_token_ce, scaling_factor=0.1)       # depth d: labels and mask shifted by d
    per_token = per_token_ce(labels, model.head(mtp.hidden))       # (L,) attention would take
    loss = token_mean(per_token, loss_mask, plan, cp_group)        # plan.cu_seqlens_padded, plan.max_seqlen
    loss.backward()                                                # the MTP gradient rides on mtp.hidden

    # grad_reduction="mean" (the default of token_mean and mtp_loss): average over CP, as DDP / FSDP do
    loss = loss.detach().clone()
    if cp_group is not None:
        for t in [loss] + [p.grad for p in model.parameters()]:
            dist.all_reduce(t, group=cp_group)
            t /= cp_size

    # per-token log-probs restored per sequence, on every rank (RL's old/ref log-probs)
    token_logp = -per_token.detach()
    restored = gather(token_logp, plan, cp_group) if cp_group is not None else token_logp
    return loss, restored, position_ids
# --- end of the step ------------------------------------------------------------------------------


class _Config:
    experimental_attention_variant = None  # "dsv4_hybrid" would pick the contiguous layout


def _rank(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    model = make_model()
    loss, restored, _ = train_step(model, make_batch(), _Config(), rank, world, dist.group.WORLD)
    return loss, restored.values(), [p.grad for p in model.parameters()]


def main(world: int = 2) -> None:
    model = make_model()
    batch = make_batch()
    loss, restored, _ = train_step(model, batch, _Config(), 0, 1, None)  # cp=1, tp=1: the rows are the tokens
    for cp_loss, cp_logp, cp_grads in run_ranks(_rank, world):
        assert torch.allclose(cp_loss, loss, rtol=1e-12, atol=0), (cp_loss, loss)
        assert torch.allclose(cp_logp, restored, rtol=1e-12, atol=0)
        for g, p in zip(cp_grads, model.parameters()):
            assert torch.allclose(g, p.grad, rtol=1e-10, atol=1e-14)
    print(f"cp={world}: loss {float(loss):.6f}, gradients and restored log-probs equal cp=1's")


if __name__ == "__main__":
    main()
