"""``cpshard`` command line: see why a layout is right.

``cpshard plan --lengths 5,3 --cp 2`` prints which rows each rank holds (SPEC.md's picture), the
padding overhead and how evenly causal-attention work is spread over the ranks (``--png`` draws
it). ``cpshard pack --lengths-file batch.txt --max-tokens 32768 --cp 8 --dp 2`` splits a global batch
into micro-batches (``cpshard.pack``) and compares the step time with verl's partition and the
bound. ``cpshard verify`` proves a configuration end to end against ``cp = 1`` (``cpshard.verify``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import torch

from cpshard.base.layout import Layout, Padding
from cpshard.plan.bshd import BshdPlan
from cpshard.plan.values import ShardPlan
from cpshard.tools.describe import PICTURE_MAX_ROWS, describe_bshd, describe_packing, describe_plan  # cpshard.cli's too

__all__ = ["main", "read_lengths_file", "verl_comparison"]


_SEPARATORS = re.compile(r"\s*,\s*|\s+")  # a comma (spaces around it allowed) or a run of whitespace


def _split(flag: str, text: str, example: str) -> list[int]:
    """Integers of ``flag`` separated by commas or whitespace (``5,3``, ``"5, 3"``, ``"5 3"``), or an
    argparse error in the flag's terms."""
    try:
        return [int(t) for t in _SEPARATORS.split(text.strip())]
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
    r"""Sequence lengths from a file: integers separated by newlines, spaces, tabs or commas (``#``
    starts a comment to the end of its line), or a JSON list. A UTF-8 byte-order mark is skipped.

    Read up to 64 MiB (a larger file, or an endless one such as ``/dev/zero``, is refused without
    reading it all); a file that is not UTF-8 text is named as such; a bad line is quoted briefly; a
    file that holds no length (empty, or only blank lines and comments) is refused naming the flag.
    A file holding ``"\ufeff5 3\n7,2  # the last two\n"`` reads as ``[5, 3, 7, 2]``."""
    where = f"--lengths-file {path}"
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{where}: is a directory; pass a text file of lengths")
    try:
        with open(path, "rb") as f:
            data = f.read(_LENGTHS_FILE_MAX + 1)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{where}: cannot be read ({exc.strerror})") from None
    if len(data) > _LENGTHS_FILE_MAX:
        raise argparse.ArgumentTypeError(f"{where}: is larger than {_LENGTHS_FILE_MAX >> 20} MiB; "
                                         "a lengths file holds integer lengths (or a JSON list)")
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), data.index(b"\0") + 1, "NUL byte")
        text = data.decode("utf-8-sig")  # a byte-order mark, as some editors on Windows write, is skipped
    except UnicodeDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{where}: is not a text file (byte {exc.start} is "
                                         f"{data[exc.start:exc.start + 1]!r}); pass integer lengths separated by "
                                         "newlines, spaces or commas, or a JSON list") from None
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{where}: not a JSON list ({exc})") from None
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise argparse.ArgumentTypeError(f"{where}: the JSON list must hold integers only")
        out = values
    else:
        out = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                out += [int(t) for t in _SEPARATORS.split(line)]
            except ValueError:
                raise argparse.ArgumentTypeError(f"{where}: line {number} is {_shown(line)}, expected integer "
                                                 "lengths separated by spaces or commas (or a JSON list)") from None
    if not out:
        raise argparse.ArgumentTypeError(f"{where}: holds no lengths (the file is empty, or only blank lines and "
                                         "comments); pass a file with at least one length, e.g. a line '5 3'")
    return _check_lengths(out, where)


def _add_lengths(p: argparse.ArgumentParser, default: Sequence[int], example: str) -> None:
    which = p.add_mutually_exclusive_group()
    which.add_argument("--lengths", type=_lengths, default=list(default),
                       help=f"sequence lengths, comma-separated, e.g. {example} "
                       f"(default {','.join(map(str, default))})")
    which.add_argument("--lengths-file", type=read_lengths_file, default=None, metavar="PATH",
                       help="sequence lengths from a file: integers separated by newlines, spaces or commas, "
                       "or a JSON list")


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


#: ``cpshard pack``'s too (``cpshard.pack``'s parameter names)
_PACK_FLAGS = {**_FLAGS, "max_tokens": "--max-tokens", "dp_size": "--dp", "min_micro_batches": "--min-micro-batches",
               "divisible_by": "--divisible-by", "group_size": "--group-size", "seed": "--seed"}
_PACK_AFTER = "=[ ,.;)"  # pack's messages name its parameters in lists too ("min_micro_batches or divisible_by,")


def _as_passed(args: argparse.Namespace, flags: dict[str, str] = _FLAGS) -> dict[str, str]:
    """``flags`` with the lengths named by the flag the user passed (``--lengths`` or ``--lengths-file``)."""
    if getattr(args, "lengths_file", None) is None:
        return flags
    return {**flags, "seqlens": "--lengths-file", "lengths": "--lengths-file"}


def _in_flags(message: str, flags: dict[str, str] = _FLAGS, after: str = "=[ ") -> str:
    """A library error (``name=value: rule. Fix: pass name ...``) with its argument names as CLI flags
    (a name followed by one of ``after``, or at the end)."""
    message = message.replace(" or leave it None", " or drop the flag").replace("same_count_across_dp=False",
                                                                                 "--no-same-count")
    return re.sub(r"\b(" + "|".join(flags) + r")\b(?=[" + re.escape(after) + r"]|$)", lambda m: flags[m.group(1)],
                  message)


_VALUE_FLAGS = {"--lengths", "--cp", "--tp", "--min-local-rows", "--length-bucket", "--max-seqlen", "--scale-to",
                "--max-tokens", "--dp", "--min-micro-batches", "--divisible-by", "--group-size", "--seed"}


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


def verl_comparison(lens: Sequence[int], *, max_tokens: int, cp_size: int, tp_size: int = 1,
                    layout: Layout | str = "zigzag", dp_size: int = 1,
                    padding: Padding | str = "aligned") -> dict[str, Any]:
    """verl's partition of the same batch (``cpshard.compat.verl_partition``: verl's own
    ``get_seqlen_balanced_partitions`` when importable, else its re-statement), each micro-batch built
    as a plan with these options: its micro-batches, per-rank works and step ratio (also with
    ``reorder="balanced"`` under the contiguous layout), its count and largest padded micro-batch."""
    from cpshard.compat import verl_partition, verl_partitioner
    from cpshard.packing.pack import plan_work, step_ratio

    part = verl_partition(lens, dp_size, max_tokens)
    part = [[mb for mb in rank if mb] for rank in part]
    kw: dict[str, Any] = {"cp_size": cp_size, "tp_size": tp_size, "layout": layout, "padding": padding}
    plans = [[ShardPlan.build([lens[i] for i in mb], **kw) for mb in rank] for rank in part]
    work = [[plan_work(p) for p in rank] for rank in plans]
    out: dict[str, Any] = {
        "source": "verl's get_seqlen_balanced_partitions" if verl_partitioner() is not None
        else "a re-statement of verl's partition (verl not importable)",
        "micro_batches": part, "work": work, "step_ratio": step_ratio(work, cp_size),
        "num_micro_batches": [len(rank) for rank in part],
        "max_rows": max(p.total_len for rank in plans for p in rank),
        "balanced_work": None, "step_ratio_balanced": None,
    }
    if Layout.parse(layout) is Layout.CONTIGUOUS and cp_size > 1:
        bal = [[plan_work(ShardPlan.build([lens[i] for i in mb], reorder="balanced", **kw)) for mb in rank]
               for rank in part]
        out["balanced_work"], out["step_ratio_balanced"] = bal, step_ratio(bal, cp_size)
    return out


def _unwritable(command: str, path: str, exc: OSError) -> int:
    print(f"cpshard {command}: --png={path!r}: cannot be written ({exc.strerror or exc}). Fix: pass a file path in an "
          "existing, writable directory.", file=sys.stderr)
    return 2


def _emit(text: str) -> int:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `cpshard plan ... | head`: stop quietly, like other CLI tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _pack_parser(sub: Any) -> argparse.ArgumentParser:
    k = sub.add_parser("pack", help="split a global batch into micro-batches under a padded token budget",
                       description="Split a global batch into micro-batches per DP rank (cpshard.pack): every "
                       "micro-batch's padded rows fit --max-tokens, and the step time (per DP rank, the sum over its "
                       "micro-batches of the slowest CP rank's causal work) is low. Prints the partition, each "
                       "micro-batch's per-rank work, and the step ratio against verl's partition and the bound.")
    _add_lengths(k, [9000, 300, 7000, 20000, 1200, 4096], "9000,300,7000")
    k.add_argument("--max-tokens", type=_at_least("--max-tokens", 1, "32768"), required=True, metavar="ROWS",
                   help="the most padded rows of one micro-batch, all CP ranks together (plan.total_len)")
    k.add_argument("--cp", type=_at_least("--cp", 1, "8"), default=2, help="context-parallel size (default 2)")
    k.add_argument("--tp", type=_at_least("--tp", 1, "2"), default=1, help="tensor-parallel size (default 1)")
    k.add_argument("--dp", type=_at_least("--dp", 1, "2"), default=1, help="data-parallel size (default 1)")
    k.add_argument("--layout", default="zigzag", choices=[m.value for m in Layout], help="default zigzag")
    k.add_argument("--padding", default=Padding.ALIGNED.value, choices=[m.value for m in Padding],
                   help="every micro-batch's plan padding (default aligned)")
    k.add_argument("--reorder", action="store_true", help="contiguous layout: every micro-batch's plan balances "
                   "its own order (reorder='balanced'); else cpshard.pack chooses the buffer order")
    k.add_argument("--min-micro-batches", type=_at_least("--min-micro-batches", 1, "4"), default=None, metavar="N",
                   help="every DP rank gets at least N micro-batches")
    k.add_argument("--divisible-by", type=_at_least("--divisible-by", 1, "2"), default=None, metavar="N",
                   help="every DP rank's count is a multiple of N (the virtual pipeline size)")
    k.add_argument("--same-count", action=argparse.BooleanOptionalAction, default=True,
                   help="the same count on every DP rank (verl's same_micro_num_in_dp; default on)")
    k.add_argument("--group-size", type=_at_least("--group-size", 1, "2"), default=1, metavar="G",
                   help="every G consecutive sequences share a micro-batch (verl's force_group_size, such as a "
                   "reward model's pairs; default 1)")
    k.add_argument("--seed", type=_at_least("--seed", 0, "0"), default=0, help="the search's tie-break seed")
    k.add_argument("--verl", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with verl's partition (its own when verl imports; default on)")
    k.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    k.add_argument("--png", default=None, metavar="PATH", help="also draw every DP rank's micro-batches as a "
                   "timeline beside verl's (needs matplotlib: pip install 'cpshard[plot]')")
    return k


def _pack_json(packing: Any, verl: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "micro_batches": [[list(mb) for mb in rank] for rank in packing.micro_batches],
        "rows": [[p.total_len for p in rank] for rank in packing.plans],
        "work": [[list(w) for w in rank] for rank in packing.work],
        "num_micro_batches": list(packing.num_micro_batches), "max_tokens": packing.max_tokens,
        "step_ratio": packing.step_ratio, "lower_bound": packing.lower_bound, "total_work": packing.total_work,
        "verl": None if verl is None else {key: verl[key] for key in (
            "source", "micro_batches", "num_micro_batches", "max_rows", "step_ratio", "step_ratio_balanced")},
    }


def _run_pack(args: argparse.Namespace, k: argparse.ArgumentParser) -> int:
    from cpshard.packing.pack import pack

    lengths = list(args.lengths_file if args.lengths_file is not None else args.lengths)
    if args.reorder and args.layout != Layout.CONTIGUOUS.value:
        k.error("--reorder balances the contiguous layout; add --layout contiguous")
    kw: dict[str, Any] = {"max_tokens": args.max_tokens, "cp_size": args.cp, "tp_size": args.tp, "layout": args.layout,
                          "dp_size": args.dp, "padding": args.padding}
    try:
        packing = pack(lengths, reorder="balanced" if args.reorder else None, min_micro_batches=args.min_micro_batches,
                       divisible_by=args.divisible_by, same_count_across_dp=args.same_count,
                       group_size=args.group_size, seed=args.seed, **kw)
        verl = None
        note = ""
        if args.verl:
            if args.group_size > 1:
                note = "verl's partition: not shown (compared only for --group-size 1)"
            elif len(lengths) % args.dp:
                note = (f"verl's partition: not shown ({len(lengths)} sequences do not divide by --dp {args.dp}; "
                        "verl's DP split takes equal counts)")
            else:
                verl = verl_comparison(lengths, **kw)
        text = json.dumps(_pack_json(packing, verl)) if args.json else describe_packing(packing, verl)
        if note and not args.json:
            text += "\n" + note
        if args.png is not None:
            from cpshard.tools.plot import draw_packing

            others = [] if verl is None else [("verl's partition", verl["work"])]
            if verl is not None and verl["balanced_work"] is not None:
                others.append(("verl's partition, reorder=balanced", verl["balanced_work"]))
            try:
                draw_packing(packing, args.png, others=others)
            except OSError as exc:
                return _unwritable("pack", args.png, exc)
            if not args.json:
                text += f"\n\nwrote {args.png}"
    except (ValueError, TypeError, ImportError) as exc:
        print(f"cpshard pack: {_in_flags(str(exc), _as_passed(args, _PACK_FLAGS), _PACK_AFTER)}", file=sys.stderr)
        return 2
    return _emit(text)


def _verify_parser(sub: Any) -> argparse.ArgumentParser:
    from cpshard.tools import verify

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
    v.add_argument("--layouts", type=_names("--layouts", Layout, "zigzag,contiguous"), default=None,
                   help="layouts (default zigzag,contiguous; not with --model hybrid)")
    v.add_argument("--padding", type=_names("--padding", Padding, "aligned,minimal"), default=None,
                   help="plan paddings: aligned, minimal, none, or several as aligned,minimal (default aligned; "
                   "with --model hybrid aligned,minimal)")
    v.add_argument("--reorder", action="store_true", help="also run every contiguous configuration with "
                   "reorder='balanced' (sequences permuted to even out causal work; not with --model hybrid, "
                   "which runs both orders of its contiguous twin)")
    v.add_argument("--dtype", default="float64", choices=list(verify.DTYPES), help="model dtype (default float64)")
    v.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    v.add_argument("--attention", default=None, choices=["reference", "naive"],
                   help="'naive': run every configuration with the layout-naive attention (zigzag must fail; "
                   "default reference; not with --model hybrid)")
    v.add_argument("--model", default="decoder", choices=["decoder", "hybrid"],
                   help="'hybrid': attention on zigzag alternating with a causal convolution and a scan on the "
                   "contiguous twin, relayout between them; both twin orders, default paddings aligned,minimal")
    v.add_argument("--backend", default=None, choices=["nccl", "gloo"],
                   help="under torchrun: the process-group backend (default nccl with CUDA, else gloo)")
    v.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    return v


def _verify_lengths(args: argparse.Namespace, v: argparse.ArgumentParser) -> list[int]:
    """The batch to verify: the lengths given, scaled by --scale-to; checked in the flags' terms."""
    from cpshard.tools import verify

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


def _hybrid_flags(args: argparse.Namespace, v: argparse.ArgumentParser) -> None:
    """``--model hybrid`` fixes what the decoder's flags choose: refuse them, never ignore them."""
    from cpshard.tools import verify

    if verify.launched() or args.backend is not None:
        v.error("--model hybrid runs on spawned gloo ranks only (not under torchrun, no --backend)")
    fixed = [(args.layouts is not None, "--layouts", "its attention runs on zigzag and its linear blocks on the "
              "contiguous twin, every configuration"),
             (args.attention is not None, "--attention", "its attention is the reference; the layout-naive check "
              "is its scan on the zigzag rows, run once at the smallest --cp and --tp"),
             (args.reorder, "--reorder", "it runs both orders of its contiguous twin (the same and "
              "reorder='balanced'), every configuration")]
    for given, flag, why in fixed:
        if given:
            v.error(f"{flag} does not apply to --model hybrid: {why}; drop {flag}")


def _run_verify(args: argparse.Namespace, v: argparse.ArgumentParser) -> int:
    from cpshard.tools import verify

    if args.model == "hybrid":
        _hybrid_flags(args, v)
    lengths = _verify_lengths(args, v)
    layouts = args.layouts or [m.value for m in Layout]
    attention = args.attention or "reference"
    reorders: list[str | None] = [None, "balanced"] if args.reorder else [None]
    try:
        if args.model == "hybrid":
            hybrid = verify.verify(lengths, cps=args.cp or [2, 4], tps=args.tp, dtype=args.dtype,
                                   paddings=args.padding or [m.value for m in Padding], reorders=[None, "balanced"],
                                   progress=args.progress, model="hybrid")
            print(json.dumps(hybrid.as_json()) if args.json else verify.format_table(hybrid), flush=True)
            return 0 if hybrid.ok else 1
        paddings = args.padding or [Padding.ALIGNED.value]
        if verify.launched():
            world = int(os.environ["WORLD_SIZE"])
            if args.cp is not None and args.cp != [world]:
                v.error(f"--cp {args.cp} under torchrun: the CP size is the world size ({world}); drop --cp")
            report = verify.verify_launched(lengths, backend=args.backend, tps=args.tp, layouts=layouts,
                                            dtype=args.dtype, attention=attention, paddings=paddings,
                                            reorders=reorders, progress=args.progress)
            if report is None:  # not rank 0: rank 0 reports; every rank exits 0 unless it failed
                return 0
        else:
            if args.backend is not None:
                v.error("--backend applies under torchrun only (torchrun --nproc-per-node N -m cpshard verify "
                        "--backend nccl); spawned ranks use gloo")
            report = verify.verify(lengths, cps=args.cp or [2, 4], tps=args.tp, layouts=layouts, dtype=args.dtype,
                                   attention=attention, paddings=paddings, reorders=reorders,
                                   progress=args.progress)
    except (ValueError, TypeError) as exc:
        print(f"cpshard verify: {_in_flags(str(exc), _as_passed(args))}", file=sys.stderr)
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
                   help=f"draw the rows (default: when at most {PICTURE_MAX_ROWS} rows; else a summary)")
    p.add_argument("--png", default=None, metavar="PATH", help="also draw the token-to-rank map and the per-rank "
                   "causal work as a PNG (needs matplotlib: pip install 'cpshard[plot]')")
    argv = _values_may_be_negative(sys.argv[1:] if argv is None else list(argv))
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in ("plan", "pack"):  # verify's parser imports cpshard.verify, which communicates: not for these
        v = sub.add_parser("verify", help="prove CP configurations end to end against cp=1 (a tiny transformer)")
    else:
        v = _verify_parser(sub)
    k = _pack_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "pack":
        torch.set_num_threads(1)
        return _run_pack(args, k)
    if args.command == "verify":
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
            from cpshard.tools.plot import draw_plans
            notes = ", ".join(f"{flag}={value}" for flag, value in (("min_local_rows", args.min_local_rows),
                                                                   ("length_bucket", args.length_bucket))
                              if value is not None)
            try:
                draw_plans(plans, args.png, notes=notes)
            except OSError as exc:
                return _unwritable("plan", args.png, exc)
            text += f"\n\nwrote {args.png}"
    except (ValueError, TypeError, ImportError) as exc:
        print(f"cpshard plan: {_in_flags(str(exc), _as_passed(args))}", file=sys.stderr)
        return 2
    return _emit(text)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
