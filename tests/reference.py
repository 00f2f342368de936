"""A deliberately naive reference for cpshard, written from /work/shared/SPEC.md only.

Everything here is plain Python: loops over sequences and tokens, Python ints, one row at a time.
Nothing is vectorised and nothing is shared with the library. Tensors are only touched at the very
edges (reading the input sequences as Python lists, building the output from a Python list).

SPEC sections mirrored here: "Padding (THD)", "Which rows a rank holds", "What a sharded row
contains", "Shifts", "Restoring outputs", "BSHD".
"""

from __future__ import annotations

import math

import torch

ZIGZAG = "zigzag"
CONTIGUOUS = "contiguous"


# --------------------------------------------------------------------------------------------------
# small integer helpers
# --------------------------------------------------------------------------------------------------


def _lcm(*xs: int) -> int:
    out = 1
    for x in xs:
        out = out * x // math.gcd(out, x)
    return out


def _roundup(n: int, a: int) -> int:
    """The smallest multiple of ``a`` that is >= ``n`` (0 stays 0)."""
    m = 0
    while m < n:
        m += a
    return m


def _layout_str(layout) -> str:
    s = layout.value if hasattr(layout, "value") else str(layout)
    assert s in (ZIGZAG, CONTIGUOUS), layout
    return s


# --------------------------------------------------------------------------------------------------
# Padding (THD)
# --------------------------------------------------------------------------------------------------


def ref_alignment_before_fp8(cp: int, tp: int, layout) -> int:
    """SPEC "Padding" table, rows 1-3."""
    layout = _layout_str(layout)
    if cp == 1:
        return tp
    if layout == ZIGZAG:
        return 2 * cp * tp
    return cp * tp


def ref_alignment(cp: int, tp: int, layout, fp8: bool = False, padding: str = "aligned") -> int:
    """The per-sequence alignment ``a`` (with fp8: ``lcm(16, a)``).

    ``padding="minimal"``: only what the layout needs, ``2 * cp`` chunks for zigzag with
    ``cp > 1``, nothing (1) otherwise; ``tp`` is then met through the total alone.
    ``padding="none"``: nothing (1) for every layout.
    """
    if padding == "none":  # no sequence padded (SPEC "Zigzag without padding"); never with fp8
        assert not fp8
        return 1
    if padding == "minimal":
        if _layout_str(layout) == ZIGZAG and cp > 1:
            a = 2 * cp
        else:
            a = 1
    else:
        assert padding == "aligned", padding
        a = ref_alignment_before_fp8(cp, tp, layout)
    if fp8:
        return _lcm(16, a)
    return a


def ref_padded_lengths(
    seqlens,
    cp: int,
    tp: int,
    layout,
    fp8: bool = False,
    min_local_rows=None,
    length_bucket=None,
    padding: str = "aligned",
) -> list:
    """Padded length ``P_i`` of every sequence (SPEC "Padding").

    Each sequence is padded to the next multiple of its alignment ``u``; then the optional
    extensions lengthen only the last sequence, always by whole multiples of ``u`` (so every
    ``P_i % u == 0`` still holds), until their condition holds together with the invariants
    (``T % cp == 0``, ``L % tp == 0``, and with fp8 ``T % (a_before_fp8 * 128) == 0``).
    """
    seqlens = [int(n) for n in seqlens]
    a0 = ref_alignment_before_fp8(cp, tp, layout)
    u = ref_alignment(cp, tp, layout, fp8, padding)
    padded = [_roundup(n, u) for n in seqlens]

    def total() -> int:
        return sum(padded)

    def invariants_hold() -> bool:
        t = total()
        if t % cp != 0:
            return False
        if (t // cp) % tp != 0:
            return False
        if fp8 and t % (a0 * 128) != 0:
            return False
        return True

    # (a) fp8: total extended to a multiple of a_before_fp8 * 128 (that is invariants_hold()).
    while not invariants_hold():
        padded[-1] += u

    # (b) min_local_rows = m: every rank holds at least m rows, i.e. T >= m * cp.
    if min_local_rows is not None:
        m = int(min_local_rows)
        while total() < m * cp or not invariants_hold():
            padded[-1] += u

    # (c) length_bucket = b: total a multiple of lcm(b, cp).
    if length_bucket is not None:
        b = int(length_bucket)
        while total() % b != 0 or total() % cp != 0 or not invariants_hold():
            padded[-1] += u

    return padded


def ref_cumsum(xs) -> list:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


# --------------------------------------------------------------------------------------------------
# Which rows a rank holds
# --------------------------------------------------------------------------------------------------


def ref_zigzag_chunks(padded, cp: int) -> list:
    """Per sequence, the sizes of its ``2 * cp`` zigzag chunks (SPEC "Which rows a rank holds" and
    "Zigzag without padding"): ``P // (2 cp)`` rows each, then the ``P mod 2 cp`` extra rows dealt one
    at a time by one counter over the whole buffer, extra ``c`` to rank ``c mod cp``: the first ``cp``
    extras of a sequence to the ranks' first chunks, the rest to their second chunks."""
    out = []
    counter = 0
    for p_i in padded:
        sizes = [int(p_i) // (2 * cp)] * (2 * cp)
        for t in range(int(p_i) % (2 * cp)):
            r = counter % cp
            counter += 1
            if t < cp:
                sizes[r] += 1
            else:
                sizes[2 * cp - 1 - r] += 1
        out.append(sizes)
    return out


def ref_rank_rows(padded, cp: int, layout, rank: int) -> list:
    """Global padded row of each local row of ``rank`` (SPEC "Which rows a rank holds")."""
    layout = _layout_str(layout)
    padded = [int(p) for p in padded]
    total = sum(padded)
    if cp == 1:
        return list(range(total))
    rows = []
    if layout == ZIGZAG:
        start = 0
        for p_i, sizes in zip(padded, ref_zigzag_chunks(padded, cp)):
            first = ref_cumsum(sizes)  # chunk j: positions [first[j], first[j + 1])
            for j in (rank, 2 * cp - 1 - rank):
                for q in range(first[j], first[j + 1]):
                    rows.append(start + q)
            start += p_i
    else:
        assert total % cp == 0
        local = total // cp
        for g in range(rank * local, (rank + 1) * local):
            rows.append(g)
    return rows


def ref_locate(padded, g: int):
    """(sequence i, position p inside the padded sequence) of global padded row ``g``."""
    start = 0
    for i, p_i in enumerate(padded):
        if start <= g < start + p_i:
            return i, g - start
        start += p_i
    raise AssertionError(f"row {g} is outside the padded buffer of total {start}")


def ref_row_info(seqlens, padded, cp: int, layout, rank: int):
    """Per local row of ``rank``: (global row, sequence id, position p, is_token)."""
    out = []
    for g in ref_rank_rows(padded, cp, layout, rank):
        i, p = ref_locate(padded, g)
        out.append((g, i, p, p < int(seqlens[i])))
    return out


# --------------------------------------------------------------------------------------------------
# What a sharded row contains / Shifts
# --------------------------------------------------------------------------------------------------


def _as_py_rows(t: torch.Tensor):
    """A sequence tensor (n, *trailing) as a Python list of rows (exact for all tested dtypes)."""
    if t.dtype == torch.bfloat16 or t.dtype == torch.float16:
        return t.float().tolist()  # bf16/fp16 -> fp32 is exact, and fp32 -> bf16 of those is exact
    return t.tolist()


def _const_row(value, trailing):
    """A row of shape ``trailing`` filled with ``value``, as a (nested) Python list."""
    if len(trailing) == 0:
        return value
    return [_const_row(value, trailing[1:]) for _ in range(trailing[0])]


def _build(rows, n_rows: int, trailing, dtype) -> torch.Tensor:
    """torch tensor (n_rows, *trailing) from a Python list of rows."""
    if n_rows == 0:
        return torch.empty((0, *trailing), dtype=dtype)
    return torch.tensor(rows, dtype=dtype).reshape(n_rows, *trailing)


def ref_value(seq_rows, n: int, p: int, shift: int, pad_value, fill, trailing):
    """The value of position ``p`` of a sequence of ``n`` tokens (SPEC "Shifts").

    ``pad_value=None`` is SPEC's default: ``fill`` for a shifted tensor (ahead or back), else 0.
    A look-ahead (``shift > 0``) past the end and a look-back (``shift < 0``) before the start are ``fill``.
    """
    if pad_value is None:
        if shift != 0:
            pad_value = fill
        else:
            pad_value = 0
    if p >= n:
        return _const_row(pad_value, trailing)
    if shift > 0 and p + shift >= n:
        return _const_row(fill, trailing)
    if shift < 0 and p + shift < 0:
        return _const_row(fill, trailing)
    return seq_rows[p + shift]


def ref_shard(
    seqs,
    seqlens,
    cp: int,
    tp: int,
    layout,
    rank: int,
    shift: int = 0,
    pad_value=None,
    fill=0,
    *,
    trailing=None,
    dtype=None,
    order=None,
    **ext,
) -> torch.Tensor:
    """Rank ``rank``'s local rows (L, *trailing) of ``shift(x, shift)``.

    ``seqs`` is a list of per-sequence tensors (n_i, *trailing). ``ext`` holds ``fp8``,
    ``min_local_rows``, ``length_bucket`` and ``padding``. ``order`` (the reordering) puts
    the caller's sequence ``order[j]`` at buffer position ``j``: the batch is padded in the
    caller's order, then each sequence moves with its padded length. ``trailing``/``dtype`` are
    only needed when there are no sequences to read them from.
    """
    seqlens = [int(n) for n in seqlens]
    padded = ref_padded_lengths(seqlens, cp, tp, layout, **ext)
    if order is not None:
        seqs = [seqs[i] for i in order]
        seqlens = [seqlens[i] for i in order]
        padded = [padded[i] for i in order]
    assert len(seqs) == len(seqlens)
    for s, n in zip(seqs, seqlens):
        assert s.shape[0] == n
    if trailing is None:
        trailing = tuple(seqs[0].shape[1:])
    if dtype is None:
        dtype = seqs[0].dtype
    py = [_as_py_rows(s) for s in seqs]
    rows = []
    for g in ref_rank_rows(padded, cp, layout, rank):
        i, p = ref_locate(padded, g)
        rows.append(ref_value(py[i], seqlens[i], p, shift, pad_value, fill, trailing))
    return _build(rows, len(rows), trailing, dtype)


def ref_shift_seqs(seqs, shift: int, fill):
    """``shift(x, k)`` restricted to token rows: per-sequence tensors of the same lengths."""
    out = []
    for s in seqs:
        n = s.shape[0]
        trailing = tuple(s.shape[1:])
        py = _as_py_rows(s)
        rows = [ref_value(py, n, p, shift, None, fill, trailing) for p in range(n)]
        out.append(_build(rows, n, trailing, s.dtype))
    return out


# --------------------------------------------------------------------------------------------------
# BSHD
# --------------------------------------------------------------------------------------------------


def ref_bshd_alignment(batch_size: int, cp: int, tp: int, layout, fp8: bool = False) -> int:
    a = ref_alignment_before_fp8(cp, tp, layout)
    if fp8:
        k = 128 * tp * cp
        a = _lcm(a, k // math.gcd(batch_size, k))
    return a


def ref_bshd_seq_len(seqlens, cp: int, tp: int, layout, fp8: bool = False, max_seqlen=None) -> int:
    seqlens = [int(n) for n in seqlens]
    m = max(seqlens) if seqlens else 0
    if max_seqlen is not None:
        m = max(m, int(max_seqlen))
    return _roundup(m, ref_bshd_alignment(len(seqlens), cp, tp, layout, fp8))


def ref_bshd_columns(M: int, cp: int, layout, rank: int) -> list:
    """Columns of rank ``rank``: the THD rule for one sequence of length M."""
    return ref_rank_rows([M], cp, layout, rank)


def ref_bshd_shard(
    seqs,
    seqlens,
    cp: int,
    tp: int,
    layout,
    rank: int,
    shift: int = 0,
    pad_value=None,
    fill=0,
    max_seqlen=None,
    fp8: bool = False,
    *,
    trailing=None,
    dtype=None,
) -> torch.Tensor:
    """Rank ``rank``'s (B, M // cp, *trailing) block."""
    seqlens = [int(n) for n in seqlens]
    if trailing is None:
        trailing = tuple(seqs[0].shape[1:])
    if dtype is None:
        dtype = seqs[0].dtype
    M = ref_bshd_seq_len(seqlens, cp, tp, layout, fp8, max_seqlen)
    cols = ref_bshd_columns(M, cp, layout, rank)
    py = [_as_py_rows(s) for s in seqs]
    rows = []
    for b in range(len(seqlens)):
        for j in cols:
            rows.append(ref_value(py[b], seqlens[b], j, shift, pad_value, fill, trailing))
    flat = _build(rows, len(rows), trailing, dtype)
    return flat.reshape(len(seqlens), len(cols), *trailing)


# --------------------------------------------------------------------------------------------------
# padded <-> jagged
# --------------------------------------------------------------------------------------------------


def ref_from_padded(x: torch.Tensor, mask: torch.Tensor):
    """Per-row extraction of the True entries, in order: list of (n_b, *trailing) tensors."""
    out = []
    for b in range(x.shape[0]):
        keep = [j for j in range(x.shape[1]) if bool(mask[b, j])]
        if keep:
            out.append(torch.stack([x[b, j] for j in keep]))
        else:
            out.append(x[b, :0])
    return out


def ref_to_padded(seqs, side: str = "right", length=None, pad_value=0):
    """(x (B, S, *trailing), mask (B, S)) with S = length or max n_b."""
    trailing = tuple(seqs[0].shape[1:])
    dtype = seqs[0].dtype
    lens = [s.shape[0] for s in seqs]
    S = max(lens) if length is None else int(length)
    py = [_as_py_rows(s) for s in seqs]
    rows, mrows = [], []
    for b, n in enumerate(lens):
        lead = 0 if side == "right" else S - n
        for j in range(S):
            if lead <= j < lead + n:
                rows.append(py[b][j - lead])
                mrows.append(True)
            else:
                rows.append(_const_row(pad_value, trailing))
                mrows.append(False)
    x = _build(rows, len(rows), trailing, dtype).reshape(len(lens), S, *trailing)
    m = torch.tensor(mrows, dtype=torch.bool).reshape(len(lens), S)
    return x, m


# --------------------------------------------------------------------------------------------------
# Losses (SPEC "Losses and the gradient convention"): the whole batch in one process, cp = 1
# --------------------------------------------------------------------------------------------------
# ``losses[i]`` / ``masks[i]``: sequence i's per-token loss (a tensor, may carry autograd) and its
# 0/1 mask (a Python list or tensor). One token at a time, Python numbers for the counts.


def _weights(mask) -> list:
    return [float(m) for m in (mask.tolist() if isinstance(mask, torch.Tensor) else mask)]


def ref_token_sum(losses, masks):
    total = 0.0
    for loss, mask in zip(losses, masks):
        for p, m in enumerate(_weights(mask)):
            if m != 0:
                total = total + loss[p] * m
    return total if isinstance(total, torch.Tensor) else torch.tensor(0.0, dtype=torch.float64)


def ref_token_count(masks) -> float:
    return sum(sum(_weights(mask)) for mask in masks)


def ref_token_mean(losses, masks):
    count = ref_token_count(masks)
    total = ref_token_sum(losses, masks)
    return total / count if count != 0 else total * 0.0


def ref_sequence_mean(losses, masks, token_reduction: str = "mean"):
    """verl's seq-mean-token-mean (or -token-sum): sequences without a labelled token are left out."""
    per_seq = []
    for loss, mask in zip(losses, masks):
        count = sum(_weights(mask))
        if count == 0:
            continue
        total = ref_token_sum([loss], [mask])
        per_seq.append(total / count if token_reduction == "mean" else total)
    if not per_seq:
        return torch.tensor(0.0, dtype=torch.float64)
    out = per_seq[0]
    for x in per_seq[1:]:
        out = out + x
    return out / len(per_seq)


def ref_mtp_depth_loss(depth_losses, masks, d: int, scale: float):
    """Depth d of SPEC's MTP loss: row p is scored under mask[p + d] (0 past the sequence's end),
    normalized by the depth's token count over the whole batch."""
    shifted = []
    for mask in masks:
        w = _weights(mask)
        shifted.append([w[p + d] if p + d < len(w) else 0.0 for p in range(len(w))])
    return scale * ref_token_mean(depth_losses, shifted)


# --------------------------------------------------------------------------------------------------
# What crosses ranks (SPEC "Shifts": sharded shifts and the multi-token halo)
# --------------------------------------------------------------------------------------------------


def ref_holders(seqlens, padded, cp: int, layout, bshd: bool = False):
    """``{(sequence, position): (rank, local row)}`` for every padded position, and per rank its rows
    as ``(sequence, position)`` in local order. A BSHD plan (``bshd``) holds the columns of one
    sequence of ``padded[0]`` in every row, row ``b``'s at local rows ``b * M / cp + ...``."""
    where, rows = {}, []
    for r in range(cp):
        mine = []
        if bshd:
            cols = ref_bshd_columns(int(padded[0]), cp, layout, r)
            for b in range(len(seqlens)):
                mine += [(b, c) for c in cols]
        else:
            mine = [ref_locate(padded, g) for g in ref_rank_rows(padded, cp, layout, r)]
        for j, key in enumerate(mine):
            where[key] = (r, j)
        rows.append(mine)
    return where, rows


def ref_crossing_rows(seqlens, padded, cp: int, layout, shift: int, bshd: bool = False) -> int:
    """Token rows, over every rank, whose source ``shift`` positions away exists and sits on another
    rank: what a sharded shift must move between ranks."""
    where, rows = ref_holders(seqlens, padded, cp, layout, bshd)
    count = 0
    for r in range(cp):
        for i, p in rows[r]:
            n = int(seqlens[i])
            if p < n and 0 <= p + shift < n and where[(i, p + shift)][0] != r:
                count += 1
    return count


def ref_crossing_halo_rows(seqlens, padded, cp: int, layout, shifts, bshd: bool = False) -> int:
    """Halo rows, over every rank, held by another rank (SPEC "Shifts", several shifts at once): a
    rank's run of consecutive positions of one sequence (under zigzag one chunk: a run is cut where
    a chunk ends) that holds a token needs the ``max(shifts)`` positions after it and the
    ``-min(shifts)`` before it that exist in its sequence."""
    ahead, back = max(max(shifts), 0), max(-min(shifts), 0)
    where, rows = ref_holders(seqlens, padded, cp, layout, bshd)
    cut = _layout_str(layout) == ZIGZAG and cp > 1
    starts = [set(ref_cumsum(sizes)) for sizes in ref_zigzag_chunks(padded, cp)] if cut else []
    count = 0
    for r in range(cp):
        runs = []
        for i, p in rows[r]:
            joined = runs and runs[-1][0] == i and runs[-1][2] == p and not (cut and p in starts[0 if bshd else i])
            if joined:
                runs[-1][2] = p + 1
            else:
                runs.append([i, p, p + 1])
        for i, first, end in runs:
            n = int(seqlens[i])
            if first >= n:
                continue
            wanted = [q for q in range(end, end + ahead) if q < n] + [q for q in range(first - back, first) if q >= 0]
            count += sum(where[(i, q)][0] != r for q in wanted)
    return count


# --------------------------------------------------------------------------------------------------
# PyTorch's context parallelism (cpshard.compat.torch_cp): the caller's padded buffer in rank order
# --------------------------------------------------------------------------------------------------


def ref_rank_order(padded_caller, order, cp: int, layout) -> list:
    """The rows of the caller's padded buffer (sequences in the caller's order, sequence ``i`` padded to
    ``padded_caller[i]``) that rank 0 holds, then rank 1, ...: SPEC "Which rows a rank holds" over the
    buffer's order (``order[j]``: the caller's sequence at buffer position ``j``; None keeps the
    caller's), each buffer row named by its row in the caller's buffer. One token at a time."""
    n = len(padded_caller)
    order = list(range(n)) if order is None else list(order)
    caller_start = ref_cumsum(padded_caller)
    padded_buffer = [padded_caller[i] for i in order]
    out = []
    for r in range(cp):
        for g in ref_rank_rows(padded_buffer, cp, layout, r):
            j, p = ref_locate(padded_buffer, g)
            out.append(caller_start[order[j]] + p)
    return out


def ref_document_mask(seqlens_caller, padded_caller) -> list:
    """``mask[q][kv]`` over the caller's padded buffer: a token attends to the tokens of its own
    document at or before it; a pad row to itself alone. One pair at a time."""
    rows = []
    for i, (n, p_i) in enumerate(zip(seqlens_caller, padded_caller)):
        for p in range(p_i):
            rows.append((i, p, p < n))
    mask = []
    for q, (i, p, token) in enumerate(rows):
        line = []
        for kv, (i2, p2, token2) in enumerate(rows):
            if token:
                line.append(token2 and i2 == i and p2 <= p)
            else:
                line.append(kv == q)
        mask.append(line)
    return mask


# --------------------------------------------------------------------------------------------------
# Varlen attention metadata (SPEC "Varlen attention metadata")
# --------------------------------------------------------------------------------------------------


def ref_varlen_rows(seqlens, padded, cp: int, layout) -> list:
    """Per rank, per local row (flattened): ``(document, position, is_token)`` of a THD plan (``seqlens``,
    ``padded``: buffer order)."""
    return [[(i, p, token) for _, i, p, token in ref_row_info(seqlens, padded, cp, layout, r)] for r in range(cp)]


def ref_bshd_varlen_rows(seqlens, M: int, cp: int, layout) -> list:
    """The same for a BSHD plan: batch row ``b``'s columns of the rank (SPEC, BSHD), row by row."""
    return [[(b, col, col < int(n)) for b, n in enumerate(seqlens) for col in ref_bshd_columns(M, cp, layout, r)]
            for r in range(cp)]


def ref_varlen_mask(rows, rank: int, window=None) -> list:
    """``mask[q][k]``: may local row ``q`` of ``rank`` attend to row ``k`` of the gathered key buffer (every
    rank's local rows, rank 0's first)? ``rows``: :func:`ref_varlen_rows` or :func:`ref_bshd_varlen_rows`.
    Both are tokens of the same document, the key at the query's position or before, and, with a
    ``window`` of ``w``, fewer than ``w`` positions before it. One pair at a time."""
    keys = [row for r in range(len(rows)) for row in rows[r]]
    mask = []
    for i, p, token in rows[rank]:
        line = []
        for i2, p2, token2 in keys:
            line.append(token and token2 and i2 == i and p2 <= p and (window is None or p - p2 < window))
        mask.append(line)
    return mask


def ref_flash_pairs(nq: int, nk: int, window_size) -> list:
    """The (query, key) pairs flash-attn's ``causal=True`` scores in one segment of ``nq`` queries and
    ``nk`` keys, its mask aligned to the bottom-right corner (flash-attn >= 2.1): key ``j`` for query
    ``i`` iff ``j <= i + nk - nq``, and, with ``window_size = (left, right)``, ``left >= 0``, also
    ``j >= i + nk - nq - left``. One pair at a time."""
    left = window_size[0]
    return [(i, j) for i in range(nq) for j in range(nk)
            if j <= i + nk - nq and (left < 0 or j >= i + nk - nq - left)]


# --------------------------------------------------------------------------------------------------
# Hugging Face models under ring x Ulysses (SPEC "Hugging Face models: ring x Ulysses")
# --------------------------------------------------------------------------------------------------


def ref_document_lengths(position_ids) -> list:
    """The runs of a packed row's position ids, one token at a time: a document starts at each 0."""
    lengths = []
    for p in [int(v) for v in position_ids]:
        if p == 0:
            lengths.append(1)
        else:
            assert lengths and p == lengths[-1], "not a run 0, 1, ..., n - 1"
            lengths[-1] += 1
    return lengths


def ref_two_axis_rows(seqs, R: int, U: int, layout, r: int, u: int, order=None, shift: int = 0, fill=0):
    """Rank ``(r, u)``'s rows: ring rank ``r``'s rows of the minimal-padding plan (``tp = U``), cut into ``U``
    consecutive equal pieces, piece ``u``; pad rows 0 (``fill`` when shifted)."""
    rows = ref_shard(seqs, [len(s) for s in seqs], R, U, layout, r, shift=shift, fill=fill, order=order,
                     padding="minimal")
    size = rows.shape[0] // U
    assert size * U == rows.shape[0]
    return rows[u * size:(u + 1) * size]
