"""``cpshard`` command line: see why a layout is right.

``cpshard plan --lengths 5,3 --cp 2`` prints which rows each rank holds (SPEC.md's picture), the
padding overhead and how evenly causal-attention work is spread over the ranks (``--png`` draws
it). ``cpshard verify`` proves a configuration end to end against ``cp = 1`` (``cpshard.verify``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from cpshard.bshd import BshdPlan
from cpshard.causal import attention_work
from cpshard.layout import Layout, Padding
from cpshard.plan import ShardPlan

__all__ = ["describe_bshd", "describe_plan", "main", "read_lengths_file"]

_PICTURE_MAX_ROWS = 96
_MAX_RANK_LINES = 16  # past this many ranks the summary and the balance show the first, the last and the busiest


def _ranks_shown(cp: int, busiest: int) -> list[int]:
    """Which ranks get a line: all up to ``_MAX_RANK_LINES``, else the first six, the busiest and the last two."""
    if cp <= _MAX_RANK_LINES:
        return list(range(cp))
    return sorted({*range(6), busiest, cp - 2, cp - 1})


def _with_gaps(lines: dict[int, str]) -> list[str]:
    """Rank lines in order, with a line saying how many ranks were left out wherever some were."""
    out, last = [], -1
    for r, line in lines.items():
        if r > last + 1:
            out.append(f"  ... ({r - last - 1} ranks, {last + 1} .. {r - 1}, left out)")
        out.append(line)
        last = r
    return out


def _row_label(seq: int, pos: int, n: int) -> str:
    return f"s{seq}p{pos}" if pos < n else "pad"


def _picture(plan: ShardPlan) -> list[str]:
    """SPEC.md's picture: the global padded buffer and each rank's rows, segments split by '|'."""
    lens = plan.seqlens_py
    cells: list[list[str]] = []
    names = ["global"] + [f"rank {r}" for r in range(plan.cp_size)]
    glob = []
    for i in range(plan.num_seqs):
        if i and plan.padded_seqlens_py[i]:
            glob.append("|")
        glob += [_row_label(i, p, lens[i]) for p in range(plan.padded_seqlens_py[i])]
    cells.append(glob)
    zigzag = plan.layout is Layout.ZIGZAG and plan.cp_size > 1
    for r in range(plan.cp_size):
        seqs, poss = plan.sequence_ids(r).tolist(), plan.position_ids(r).tolist()
        # zigzag rows split at chunk boundaries, contiguous rows at sequence boundaries
        chunk = [p // max(plan.padded_seqlens_py[s] // (2 * plan.cp_size), 1) if zigzag else 0
                 for s, p in zip(seqs, poss)]
        line: list[str] = []
        for j, (s, p) in enumerate(zip(seqs, poss)):
            if j and (s, chunk[j]) != (seqs[j - 1], chunk[j - 1]):
                line.append("|")
            line.append(_row_label(s, p, lens[s]))
        cells.append(line)
    width = max((len(c) for line in cells for c in line), default=1)
    head = max(len(n) for n in names)
    return [f"{name:<{head}} : " + " ".join(c.ljust(width) if c != "|" else c for c in line).rstrip()
            for name, line in zip(names, cells)]


def _summary(plan: ShardPlan, ranks: list[int]) -> list[str]:
    """The picture's content for long batches: each rank's runs of consecutive rows, ``s<seq>:<first>-<last>``
    (positions inside the padded sequence, inclusive), capped."""
    lines = {}
    for r in ranks:  # over the rank's segments, never its rows (a summary costs nothing per token)
        seg = plan.indices().segments(r)
        held = np.flatnonzero(seg.length)
        seq, pos, length = seg.seq[held], seg.pos[held], seg.length[held]
        new = np.ones(seq.size, dtype=bool)
        new[1:] = (seq[1:] != seq[:-1]) | (pos[1:] != pos[:-1] + length[:-1])
        first = np.flatnonzero(new)
        last = np.append(first[1:] - 1, seq.size - 1)
        ends = pos[last] + length[last] - 1
        runs = [f"s{s}:{a}-{b}" for s, a, b in zip(seq[first].tolist(), pos[first].tolist(), ends.tolist())]
        shown = runs if len(runs) <= 9 else runs[:6] + ["..."] + runs[-2:] + [f"({len(runs)} runs)"]
        lines[r] = f"rank {r} : {' '.join(shown)}"
    return ["rows per rank as runs s<sequence>:<first position>-<last position>:"] + _with_gaps(lines)


def _balance(plan: ShardPlan, work: list[int], ranks: list[int]) -> list[str]:
    """Per rank: rows, token rows, and causal-attention work (sum over token rows of keys seen)."""
    lines = {}
    for r in ranks:
        tokens = int(plan.indices().segments(r).tokens.sum())
        lines[r] = f"{r:>6} {plan.local_len:>8} {tokens:>8} {plan.local_len - tokens:>8} {work[r]:>14}"
    out = [f"{'rank':>6} {'rows':>8} {'tokens':>8} {'pad':>8} {'causal work':>14}"] + _with_gaps(lines)
    mean = sum(work) / len(work)
    ratio = max(work) / mean if mean else 1.0
    out.append(f"causal work max/mean = {ratio:.3f} (1.000 is perfectly balanced)")
    return out


def _cap(values: Sequence[object], head: int = 8, tail: int = 2) -> str:
    """A list as Python prints it, or its ends and a count when it is long (output stays small)."""
    items = list(values)
    if len(items) <= head + tail + 1:
        return str(items)
    shown = ", ".join(map(str, items[:head])) + ", ..., " + ", ".join(map(str, items[-tail:]))
    return f"[{shown}] ({len(items)} values)"


def describe_plan(plan: ShardPlan, *, picture: bool | None = None) -> str:
    """The text ``cpshard plan`` prints for ``plan``: its sizes and padding, which rows each rank holds,
    and each rank's causal-attention work (max / mean: 1.000 is balanced).

    ``picture=None`` draws SPEC.md's picture (every row, as below) up to 96 rows and else summarises
    each rank's runs of consecutive rows (``s<sequence>:<first>-<last>``); ``True`` / ``False`` force
    either. Long lists are cut to their ends and a count, and past 16 ranks only the first six, the
    busiest and the last two get a line, so the text stays a few kilobytes at any scale::

        >>> text = describe_plan(ShardPlan.build([5, 3], cp_size=2))
        >>> for line in text.splitlines()[5:8]:
        ...     print(line)
        global : s0p0 s0p1 s0p2 s0p3 s0p4 pad  pad  pad  | s1p0 s1p1 s1p2 pad
        rank 0 : s0p0 s0p1 | pad  pad  | s1p0 | pad
        rank 1 : s0p2 s0p3 | s0p4 pad  | s1p1 | s1p2
    """
    out = [
        repr(plan),
        f"alignment a = {plan.alignment}; padded_seqlens = {_cap(plan.padded_seqlens_py)}",
        f"cu_seqlens_padded = {_cap(plan.cu_seqlens_padded_py)}; max_seqlen = {plan.max_seqlen}",
        f"tokens = {plan.num_tokens}, padded rows T = {plan.total_len}, rows per rank L = {plan.local_len} "
        f"(L / tp = {plan.local_len // plan.tp_size}); padding overhead = {100 * plan.padding_overhead:.1f}%",
        "",
    ]
    work = attention_work(plan)
    ranks = _ranks_shown(plan.cp_size, max(range(plan.cp_size), key=work.__getitem__))
    if plan.order is not None:  # s<i> below is the buffer's i-th sequence
        out[-1:] = [f"order = {_cap(plan.order)} (buffer position -> your sequence; s<i> is buffer position i)", ""]
    if picture is None and plan.total_len > _PICTURE_MAX_ROWS:
        out += [f"(picture omitted: {plan.total_len} rows > {_PICTURE_MAX_ROWS}; pass --picture to force it)", ""]
        out += _summary(plan, ranks) + [""]
    elif picture is False:
        out += ["(picture omitted: --no-picture)", ""]
    else:
        out += _picture(plan) + [""]
    out += _balance(plan, work, ranks)
    return "\n".join(out)


def describe_bshd(plan: BshdPlan) -> str:
    """The text ``cpshard plan --bshd`` prints: each rank's columns of every row."""
    out = [repr(plan), f"alignment = {plan.alignment}; every row padded to M = {plan.max_seqlen}, "
           f"{plan.local_len} columns per rank; padding overhead = {100 * plan.padding_overhead:.1f}%", ""]
    head = max(len(f"rank {plan.cp_size - 1}"), len("row 0"))
    for r in range(plan.cp_size):
        out.append(f"{f'rank {r}':<{head}} : columns {_cap(plan.columns(r).tolist())}")
    if plan.num_seqs * plan.max_seqlen <= 4 * _PICTURE_MAX_ROWS:
        out.append("")
        for b, n in enumerate(plan.seqlens_py):
            cells = [[f"t{c}" if c < n else "." for c in plan.columns(r).tolist()] for r in range(plan.cp_size)]
            width = max((len(c) for rank in cells for c in rank), default=1)
            shown = " | ".join(" ".join(c.ljust(width) for c in rank) for rank in cells)
            out.append(f"{f'row {b}':<{head}} : {shown}".rstrip())
    return "\n".join(out)


def _split(flag: str, text: str, example: str) -> list[int]:
    """Comma-separated integers of ``flag``, or an argparse error in the flag's terms."""
    try:
        return [int(t) for t in text.replace(" ", "").split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated ints, e.g. {flag} {example}") from None


def _check_lengths(lengths: list[int], where: str) -> list[int]:
    """Lengths are token counts: a negative one is named by its place (1-based, as a user counts)."""
    for number, n in enumerate(lengths, 1):
        if n < 0:
            raise argparse.ArgumentTypeError(f"{where}: length {number} is {n}; a sequence length is a token "
                                             "count >= 0 (e.g. --lengths 5,3,0)")
    return lengths


def _lengths(text: str) -> list[int]:
    return _check_lengths(_split("--lengths", text, "5,3"), repr(text))


_LENGTHS_FILE_MAX = 64 << 20  # bytes: 10 M lengths of 6 digits; a plan holds fewer than 2**31 rows anyway


def _shown(line: str, width: int = 40) -> str:
    return repr(line) if len(line) <= width else repr(line[:width]) + f" ... ({len(line)} characters)"


def read_lengths_file(path: str) -> list[int]:
    """Sequence lengths from a file: one per line (blank lines and ``#`` comments ignored), or a JSON list.

    Read up to 64 MiB (a larger file, or an endless one such as ``/dev/zero``, is refused without
    reading it all); a file that is not UTF-8 text is named as such; a bad line is quoted briefly."""
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"--lengths-file={path!r}: is a directory; pass a text file of lengths")
    try:
        with open(path, "rb") as f:
            data = f.read(_LENGTHS_FILE_MAX + 1)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"--lengths-file={path!r}: cannot be read ({exc.strerror})") from None
    if len(data) > _LENGTHS_FILE_MAX:
        raise argparse.ArgumentTypeError(f"--lengths-file={path!r}: is larger than {_LENGTHS_FILE_MAX >> 20} MiB; "
                                         "a lengths file holds one integer per line (or a JSON list)")
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), data.index(b"\0") + 1, "NUL byte")
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--lengths-file={path!r}: is not a text file (byte {exc.start} is "
                                         f"{data[exc.start:exc.start + 1]!r}); pass one integer length per "
                                         "line, or a JSON list") from None
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lengths-file={path!r}: not a JSON list ({exc})") from None
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise argparse.ArgumentTypeError(f"--lengths-file={path!r}: the JSON list must hold integers only")
        return _check_lengths(values, f"--lengths-file={path!r}")
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            out.append(int(line))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--lengths-file={path!r}: line {number} is {_shown(line)}, expected "
                                             "one integer length per line (or a JSON list)") from None
    return _check_lengths(out, f"--lengths-file={path!r}")


def _add_lengths(p: argparse.ArgumentParser, default: Sequence[int], example: str) -> None:
    which = p.add_mutually_exclusive_group()
    which.add_argument("--lengths", type=_lengths, default=list(default),
                       help=f"sequence lengths, e.g. {example} (default {','.join(map(str, default))})")
    which.add_argument("--lengths-file", type=read_lengths_file, default=None, metavar="PATH",
                       help="sequence lengths from a file: one per line, or a JSON list")


def _positive_ints(flag: str, example: str) -> Any:
    """An argparse type: comma-separated integers >= 1 for ``flag``."""
    def parse(text: str) -> list[int]:
        values = _split(flag, text, example)
        bad = [v for v in values if v < 1]
        if bad:
            raise argparse.ArgumentTypeError(f"{text!r}: {bad[0]} is not a size; every value must be an integer "
                                             f">= 1, e.g. {flag} {example}")
        return values
    return parse


def _at_least(flag: str, minimum: int, example: str) -> Any:
    """An argparse type: one integer >= ``minimum`` for ``flag``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer, e.g. {flag} {example}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is too small; {flag} must be >= {minimum}, e.g. "
                                             f"{flag} {example}")
        return value
    return parse


def _names(flag: str, enum_cls: Any, example: str) -> Any:
    """An argparse type: comma-separated values of the string enum ``enum_cls`` (any case) for ``flag``."""
    valid = [m.value for m in enum_cls]

    def parse(text: str) -> list[str]:
        values = [x.lower() for x in text.replace(" ", "").split(",") if x]
        for x in values:
            if x not in valid:
                raise argparse.ArgumentTypeError(f"{x!r} is not one of {', '.join(valid)} (comma-separated, e.g. "
                                                 f"{flag} {example})")
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: expected one or more of {', '.join(valid)}, e.g. "
                                             f"{flag} {example}")
        return list(dict.fromkeys(values))
    return parse


#: the Python names in library messages, as the flags a CLI user typed (plan and verify)
_FLAGS = {"seqlens": "--lengths", "lengths": "--lengths", "cp_size": "--cp", "tp_size": "--tp",
          "min_local_rows": "--min-local-rows", "length_bucket": "--length-bucket", "max_seqlen": "--max-seqlen"}


def _in_flags(message: str) -> str:
    """A library error (``name=value: rule. Fix: pass name ...``) with its argument names as CLI flags."""
    message = message.replace(" or leave it None", " or drop the flag")
    return re.sub(r"\b(" + "|".join(_FLAGS) + r")\b(?=[=\[ ]|$)", lambda m: _FLAGS[m.group(1)], message)


_VALUE_FLAGS = {"--lengths", "--cp", "--tp", "--min-local-rows", "--length-bucket", "--max-seqlen", "--scale-to"}


def _values_may_be_negative(argv: Sequence[str]) -> list[str]:
    """``--lengths -3,5`` as ``--lengths=-3,5``: argparse takes a value that starts with '-' and is
    not one plain number for an option, and answers "expected one argument"; joined, the value
    reaches its parser and gets a message about the value."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in _VALUE_FLAGS and re.match(r"-\d", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _verify_parser(sub: Any) -> argparse.ArgumentParser:
    from cpshard import verify

    v = sub.add_parser("verify", help="prove CP configurations end to end against cp=1 (a tiny transformer)",
                       description="Prove context-parallel configurations end to end on this machine: a tiny "
                       "transformer's loss, per-token log-probs, MTP loss and every gradient at each cp, tp and "
                       "layout, against cp=1 (exit status 1 on any mismatch).")
    _add_lengths(v, verify.DEFAULT_LENGTHS, "97,23,1,5")
    v.add_argument("--scale-to", type=_at_least("--scale-to", 2, "8192"), default=None, metavar="TOKENS",
                   help="scale the lengths down to TOKENS in all, keeping the shape of their distribution (every "
                   f"length times one factor, rounded; at most {verify.MAX_TOKENS})")
    v.add_argument("--cp", type=_positive_ints("--cp", "2,4"), default=None,
                   help="context-parallel sizes (default 2,4; under torchrun the world size)")
    v.add_argument("--tp", type=_positive_ints("--tp", "1,2"), default=[1, 2],
                   help="tensor-parallel alignments (default 1,2)")
    v.add_argument("--layouts", type=_names("--layouts", Layout, "zigzag,contiguous"),
                   default=[m.value for m in Layout], help="layouts (default zigzag,contiguous)")
    v.add_argument("--padding", type=_names("--padding", Padding, "aligned,minimal"), default=[Padding.ALIGNED.value],
                   help="plan paddings: aligned (default), minimal, or both as aligned,minimal")
    v.add_argument("--reorder", action="store_true", help="also run every contiguous configuration with "
                   "reorder='balanced' (sequences permuted to even out causal work)")
    v.add_argument("--dtype", default="float64", choices=list(verify.DTYPES), help="model dtype (default float64)")
    v.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    v.add_argument("--attention", default="reference", choices=["reference", "naive"],
                   help="'naive': run every configuration with the layout-naive attention (zigzag must fail)")
    v.add_argument("--model", default="decoder", choices=["decoder", "hybrid"],
                   help="'hybrid': attention on zigzag alternating with a causal convolution and a scan on the "
                   "contiguous twin, relayout between them (default paddings aligned,minimal and both twin orders)")
    v.add_argument("--backend", default=None, choices=["nccl", "gloo"],
                   help="under torchrun: the process-group backend (default nccl with CUDA, else gloo)")
    v.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    return v


def _verify_lengths(args: argparse.Namespace, v: argparse.ArgumentParser) -> list[int]:
    """The batch to verify: the lengths given, scaled by --scale-to; checked in the flags' terms."""
    from cpshard import verify

    flag = "--lengths-file" if args.lengths_file is not None else "--lengths"
    lengths = list(args.lengths_file if args.lengths_file is not None else args.lengths)
    cap = verify.MAX_TOKENS
    if args.scale_to is not None:
        if args.scale_to > cap:
            v.error(f"argument --scale-to: {args.scale_to} is more than the {cap} tokens verify takes; pass "
                    f"--scale-to {cap} or less")
        nonempty = sum(1 for n in lengths if n)
        if nonempty > cap:
            v.error(f"argument {flag}: {nonempty} non-empty sequences, more than the {cap} tokens verify takes "
                    "can hold (each keeps at least one token); verify part of the batch")
        if nonempty > args.scale_to:
            v.error(f"argument --scale-to: {args.scale_to} tokens cannot hold the batch's {nonempty} non-empty "
                    f"sequences (each keeps at least one token); pass --scale-to {max(nonempty, 2)} or more, "
                    "or verify part of the batch")
        scaled = verify.scale_lengths(lengths, args.scale_to)
        if scaled != lengths and os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 tells
            total = sum(lengths)
            ranked = sorted(zip(lengths, scaled))
            longest, median = ranked[-1], ranked[len(ranked) // 2]
            print(f"cpshard verify: --scale-to {args.scale_to}: {len(lengths)} lengths, {total} tokens, each times "
                  f"{args.scale_to / total:.4g} and rounded (the shape of their distribution kept; non-empty ones "
                  f"keep at least one token): longest {longest[0]} -> {longest[1]}, median {median[0]} -> "
                  f"{median[1]}", file=sys.stderr)
        lengths = scaled
    total = sum(lengths)
    if total > cap:
        v.error(f"argument {flag}: {total} tokens, more than the {cap} that verify takes (its reference attention "
                f"is exact, not fast); add --scale-to {cap} to scale the batch down keeping the shape of its lengths")
    if all(n < 2 for n in lengths):
        v.error(f"argument {flag}: no sequence has 2 tokens, so no token has a label to check; add a longer one, "
                "e.g. --lengths 9,1,4")
    return lengths


def _run_verify(args: argparse.Namespace, v: argparse.ArgumentParser) -> int:
    from cpshard import verify

    lengths = _verify_lengths(args, v)
    layouts, paddings = args.layouts, args.padding
    reorders: list[str | None] = [None, "balanced"] if args.reorder else [None]
    try:
        if args.model == "hybrid":
            if verify.launched() or args.backend is not None:
                v.error("--model hybrid runs on spawned gloo ranks only (not under torchrun, no --backend)")
            hybrid = verify.verify(lengths, cps=args.cp or [2, 4], tps=args.tp, dtype=args.dtype,
                                   paddings=paddings if paddings != [Padding.ALIGNED.value] else ["aligned", "minimal"],
                                   reorders=[None, "balanced"], progress=args.progress, model="hybrid")
            print(json.dumps(hybrid.as_json()) if args.json else verify.format_table(hybrid), flush=True)
            return 0 if hybrid.ok else 1
        if verify.launched():
            world = int(os.environ["WORLD_SIZE"])
            if args.cp is not None and args.cp != [world]:
                v.error(f"--cp {args.cp} under torchrun: the CP size is the world size ({world}); drop --cp")
            report = verify.verify_launched(lengths, backend=args.backend, tps=args.tp, layouts=layouts,
                                            dtype=args.dtype, attention=args.attention, paddings=paddings,
                                            reorders=reorders, progress=args.progress)
            if report is None:  # not rank 0: rank 0 reports; every rank exits 0 unless it failed
                return 0
        else:
            if args.backend is not None:
                v.error("--backend applies under torchrun only (torchrun --nproc-per-node N -m cpshard verify "
                        "--backend nccl); spawned ranks use gloo")
            report = verify.verify(lengths, cps=args.cp or [2, 4], tps=args.tp, layouts=layouts, dtype=args.dtype,
                                   attention=args.attention, paddings=paddings, reorders=reorders,
                                   progress=args.progress)
    except (ValueError, TypeError) as exc:
        print(f"cpshard verify: {_in_flags(str(exc))}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_json()) if args.json else verify.format_table(report), flush=True)
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cpshard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print which rows each context-parallel rank holds")
    _add_lengths(p, [5, 3], "5,3")
    p.add_argument("--cp", type=_at_least("--cp", 1, "2"), default=2, help="context-parallel size (default 2)")
    p.add_argument("--tp", type=_at_least("--tp", 1, "2"), default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--layout", default="zigzag", choices=[m.value for m in Layout] + ["both"],
                   help="'both': zigzag and contiguous, one after the other (side by side with --png)")
    p.add_argument("--fp8", action="store_true", help="fp8 padding (lcm(16, a) per sequence, a * 128 total)")
    p.add_argument("--padding", default=None, choices=[m.value for m in Padding],
                   help="'minimal': pad each sequence only as far as the layout needs (default 'aligned', SPEC's)")
    p.add_argument("--reorder", action="store_true", default=None,
                   help="contiguous layout: permute the sequences to even out causal work (reorder='balanced')")
    p.add_argument("--min-local-rows", type=_at_least("--min-local-rows", 0, "64"), default=None, metavar="N",
                   help="every rank holds at least N rows (the last sequence's padding is extended)")
    p.add_argument("--length-bucket", type=_at_least("--length-bucket", 1, "1024"), default=None, metavar="N",
                   help="the padded total is a multiple of lcm(N, cp) (the last sequence's padding is extended)")
    p.add_argument("--bshd", action="store_true", help="plan a padded (B, S) batch instead of a packed one")
    p.add_argument("--max-seqlen", type=_at_least("--max-seqlen", 1, "4096"), default=None,
                   help="with --bshd: the forced padded length")
    p.add_argument("--picture", action=argparse.BooleanOptionalAction, default=None,
                   help=f"draw the rows (default: when at most {_PICTURE_MAX_ROWS} rows; else a summary)")
    p.add_argument("--png", default=None, metavar="PATH", help="also draw the token-to-rank map and the per-rank "
                   "causal work as a PNG (needs matplotlib: pip install 'cpshard[plot]')")
    v = _verify_parser(sub)
    args = parser.parse_args(_values_may_be_negative(sys.argv[1:] if argv is None else list(argv)))
    if args.command == "verify":
        logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
        torch.set_num_threads(1)
        return _run_verify(args, v)
    lengths = args.lengths_file if args.lengths_file is not None else args.lengths
    layouts = [m.value for m in Layout] if args.layout == "both" else [args.layout]
    not_for = ([("--min-local-rows", args.min_local_rows), ("--length-bucket", args.length_bucket),
                ("--picture/--no-picture", args.picture), ("--png", args.png), ("--padding", args.padding),
                ("--reorder", args.reorder)]
               if args.bshd else [("--max-seqlen", args.max_seqlen)])
    ignored = [flag for flag, value in not_for if value is not None]
    if ignored:
        mode = "with --bshd (a padded batch)" if args.bshd else "without --bshd (a packed batch)"
        p.error(f"{', '.join(ignored)} does not apply {mode}; drop it"
                     + ("" if args.bshd else " or add --bshd"))
    # torch logs a deprecation notice from torch.fx when nested tensors are first used; not ours to show
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    try:
        texts, plans = [], []
        for layout in layouts:
            if args.bshd:
                texts.append(describe_bshd(BshdPlan.build(lengths, cp_size=args.cp, tp_size=args.tp, layout=layout,
                                                          fp8=args.fp8, max_seqlen=args.max_seqlen)))
                continue
            reorder = "balanced" if args.reorder and layout == Layout.CONTIGUOUS.value else None
            if args.reorder and len(layouts) == 1 and reorder is None:
                p.error("--reorder balances the contiguous layout; add --layout contiguous (or both)")
            plan = ShardPlan.build(lengths, cp_size=args.cp, tp_size=args.tp, layout=layout, fp8=args.fp8,
                                   min_local_rows=args.min_local_rows, length_bucket=args.length_bucket,
                                   padding=args.padding or Padding.ALIGNED, reorder=reorder)
            plans.append(plan)
            texts.append(describe_plan(plan, picture=args.picture))
        text = "\n\n".join(texts)
        if args.png is not None:
            from cpshard.plot import draw_plans
            notes = ", ".join(f"{flag}={value}" for flag, value in (("min_local_rows", args.min_local_rows),
                                                                   ("length_bucket", args.length_bucket))
                              if value is not None)
            try:
                draw_plans(plans, args.png, notes=notes)
            except OSError as exc:
                print(f"cpshard plan: --png={args.png!r}: cannot be written ({exc.strerror or exc}). Fix: pass a "
                      "file path in an existing, writable directory.", file=sys.stderr)
                return 2
            text += f"\n\nwrote {args.png}"
    except (ValueError, TypeError, ImportError) as exc:
        print(f"cpshard plan: {_in_flags(str(exc))}", file=sys.stderr)
        return 2
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `cpshard plan ... | head`: stop quietly, like other CLI tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
