"""A whole training step with cpshard on real ranks: ids, labels, loss mask, positions, the loss
normalised over the CP group, and the per-token log-probs restored per sequence.

Run it: ``python examples/train_step.py`` (2 gloo processes on this machine). It checks that the
loss, every parameter gradient and the restored log-probs equal the single-process step's. The
model is a toy that treats tokens independently (embedding, then the output layer): a real model
also hands its attention kernel ``plan.cu_seqlens_padded`` and ``plan.max_seqlen``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard import ShardPlan, layout_for, shard
from cpshard.distributed import gather
from cpshard.spawn import run_ranks

VOCAB, HIDDEN = 50, 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB)).double()


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

    logits = model(input_ids)                                      # (L, V); attention would take
    logp = F.log_softmax(logits, -1)                               # plan.cu_seqlens_padded, plan.max_seqlen
    token_logp = logp.gather(-1, labels.clamp(min=0)[:, None])[:, 0] * loss_mask

    # normalise by the CP group's token count: each rank's loss is its share of the batch mean
    count = loss_mask.sum().to(logp.dtype)
    if cp_group is not None:
        dist.all_reduce(count, group=cp_group)
    loss = -token_logp.sum() / count
    loss.backward()
    loss = loss.detach().clone()
    if cp_group is not None:  # the batch's loss and gradient are the sums of the ranks' (as DP x CP reduction does)
        dist.all_reduce(loss, group=cp_group)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=cp_group)

    # per-token log-probs restored per sequence, on every rank (RL's old/ref log-probs)
    restored = gather(token_logp.detach(), plan, cp_group) if cp_group is not None else token_logp.detach()
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
