"""The command line in its user's terms: flags and values in every message, negative values parsed
as values, ``--scale-to`` and the run-time estimate of ``cpshard verify`` (no process is spawned here)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpshard import ShardPlan
from cpshard.cli import main as cli_main
from cpshard.verify import MAX_TOKENS, RANK_OVERHEAD, estimate_seconds, scale_lengths

PYTHON_TERMS = ("cpshard.Layout", "cpshard.Padding",
                "cpshard.layout.Padding", "member", "None", "cp_size", "seqlens", "expected one "
                "argument")


def _refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert not any(term in err for term in PYTHON_TERMS), err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "--lengths", "-3,5"],
     "argument --lengths: '-3,5': length 1 is -3; a sequence length is a token count >= 0"),
    (["plan", "--lengths", "5,-3"], "length 2 is -3"),
    (["plan", "--lengths", "-3"], "length 1 is -3"),
    (["plan", "--cp", "0"], "argument --cp: 0 is too small; --cp must be >= 1"),
    (["plan", "--cp", "-2"], "argument --cp: -2 is too small"),
    (["plan", "--tp", "two"], "argument --tp: 'two': expected an integer, e.g. --tp 2"),
    (["plan", "--min-local-rows", "-1"], "--min-local-rows must be >= 0"),
    (["plan", "--length-bucket", "0"], "--length-bucket must be >= 1"),
    (["verify", "--layouts", "zigzog"], "argument --layouts: 'zigzog' is not one of zigzag, contiguous"),
    (["verify", "--layouts", "zigzag,ring"], "'ring' is not one of zigzag, contiguous"),
    (["verify", "--padding", "tight"], "argument --padding: 'tight' is not one of aligned, minimal"),
    (["verify", "--cp", "2,0"], "argument --cp: '2,0': 0 is not a size; every value must be an integer >= 1"),
    (["verify", "--cp", "-2,4"], "-2 is not a size"),
    (["verify", "--tp", "1,x"], "argument --tp: '1,x': expected comma-separated ints, e.g. --tp 1,2"),
    (["verify", "--lengths", "-1,9"], "length 1 is -1"),
    (["verify", "--lengths", "0,1"], "argument --lengths: no sequence has 2 tokens"),
    (["verify", "--lengths", "9000"], f"9000 tokens, more than the {MAX_TOKENS} that verify takes (its reference "
     f"attention is exact, not fast); add --scale-to {MAX_TOKENS}"),
    (["verify", "--lengths", "9000", "--scale-to", "9000"], f"argument --scale-to: 9000 is more than the {MAX_TOKENS}"),
    (["verify", "--lengths", "1,1,1", "--scale-to", "2"], "2 tokens cannot hold the batch's 3 non-empty sequences"),
    (["verify", "--scale-to", "-5"], "argument --scale-to: -5 is too small"),
])
def test_messages_name_flags_and_values(capsys, argv, message):
    assert message in _refused(capsys, [*argv, *(["--no-progress"] if argv[0] == "verify" else [])])


def test_scale_to_refuses_more_sequences_than_the_cap_holds(capsys, tmp_path):
    path = tmp_path / "many.txt"
    path.write_text("\n".join(["3"] * (MAX_TOKENS + 1)))
    line = _refused(capsys, ["verify", "--lengths-file", str(path), "--scale-to", "100", "--no-progress"])
    assert f"argument --lengths-file: {MAX_TOKENS + 1} non-empty sequences, more than the {MAX_TOKENS} tokens" in line


def test_lengths_file_with_a_negative_length(capsys, tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("5\n-2\n")
    assert "length 2 is -2" in _refused(capsys, ["plan", "--lengths-file", str(path)])
    path.write_text("[5, 3, -1]")
    assert "length 3 is -1" in _refused(capsys, ["plan", "--lengths-file", str(path)])


def test_library_errors_reach_the_user_as_flags(capsys):
    """Rules the plan checks itself (not argparse) are printed with the flags' names."""
    assert cli_main(["plan", "--bshd", "--lengths", "5,3", "--cp", "2", "--max-seqlen", "4"]) == 2
    err = capsys.readouterr().err
    assert "--max-seqlen=4: must be >= the longest sequence (5). Fix: pass --max-seqlen >= 5" in err
    assert "max_seqlen" not in err and "None" not in err


def test_values_that_start_with_a_dash_only_for_value_flags(capsys):
    assert cli_main(["plan", "--lengths", "5,3", "--cp", "2"]) == 0  # untouched
    assert "rank 1 : s0p2 s0p3" in capsys.readouterr().out
    # a flag after --lengths is still a flag (argparse's answer), not a value
    assert "argument --lengths: expected one argument" in _refused_plain(capsys, ["plan", "--lengths", "--cp", "2"])


def _refused_plain(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit):
        cli_main(argv)
    return capsys.readouterr().err


# -- --scale-to ---------------------------------------------------------------------------------------------


def test_scale_lengths_where_the_factor_is_exact():
    assert scale_lengths([4000, 1000, 0, 3000], 800) == [400, 100, 0, 300]  # f = 0.1, no rounding
    assert scale_lengths([7, 5], 100) == [7, 5]  # fits already: unchanged
    assert scale_lengths([10_000, 1], 5001) == [5000, 1]  # f just over 1/2: the one-token sequence stays


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=60), st.integers(60, MAX_TOKENS))
def test_scale_lengths_keeps_the_shape(lengths, tokens):
    got = scale_lengths(lengths, tokens)
    total = sum(lengths)
    if total <= tokens:
        assert got == lengths
        return
    assert sum(got) == tokens and len(got) == len(lengths)
    assert all((g == 0) == (n == 0) for g, n in zip(got, lengths))  # empty stays empty, nothing else becomes empty
    raised = sum(1 for n in lengths if n and n * tokens < total)  # raised to one token: what they cost
    for g, n in zip(got, lengths):  # is taken from the longest
        exact = n * tokens / total
        if n * tokens >= total:
            assert exact - 1 - raised < g < exact + 1, (g, n, exact)
    for (n_a, g_a), (n_b, g_b) in zip(sorted(zip(lengths, got)), sorted(zip(lengths, got))[1:]):
        assert g_a <= g_b or n_a == n_b, (n_a, g_a, n_b, g_b)  # a longer sequence never gets fewer tokens


def test_scale_to_reaches_verify_scaled(capsys, monkeypatch, tmp_path):
    from cpshard import verify

    seen = {}

    def fake(lengths, **kwargs):
        seen["lengths"] = list(lengths)
        raise ValueError("stopped here")  # the CLI prints it and exits 2; nothing spawned

    monkeypatch.setattr(verify, "verify", fake)
    path = tmp_path / "batch.txt"
    path.write_text("\n".join(["6000", "3000", "1000", "0", "2"]))
    assert cli_main(["verify", "--lengths-file", str(path), "--scale-to", "1000", "--no-progress"]) == 2
    # f = 1000 / 10002: 599.88, 299.94, 99.98, 0, 0.19996 -> floors 599, 299, 99, 0 and 1 (kept non-empty) = 998;
    # the two tokens left go to the largest remainders, 99.98 and 299.94
    assert seen["lengths"] == [599, 300, 100, 0, 1]
    err = capsys.readouterr().err
    assert "--scale-to 1000: 5 lengths, 10002 tokens, each times 0.09998 and rounded" in err
    assert "longest 6000 -> " in err and "cpshard verify: stopped here" in err


# -- the estimate -------------------------------------------------------------------------------------------


def test_estimate_follows_its_rule():
    """A zigzag plan of one sequence of 8 rows at cp=2: rank 0 holds positions 0, 1, 6, 7 (work 1+2+7+8 = 18),
    rank 1 positions 2..5 (3+4+5+6 = 18), so each rank has half the work; contiguous: 1+2+3+4 = 10 and
    5+6+7+8 = 26, the busiest 26/36."""
    zigzag = ShardPlan.build([8], cp_size=2)
    contiguous = ShardPlan.build([8], cp_size=2, layout="contiguous")
    def rule(*args, **kwargs):
        return estimate_seconds(*args, **kwargs, overhead=1.0)

    assert rule(10.0, {2: [zigzag]}, 2, startup=0.0) == pytest.approx(5.0)
    assert rule(10.0, {2: [contiguous]}, 2, startup=0.0) == pytest.approx(10.0 * 26 / 36)
    assert rule(10.0, {2: [zigzag]}, 1, startup=0.0) == pytest.approx(10.0)  # two ranks, one core
    assert rule(10.0, {2: [zigzag, contiguous]}, 1, startup=3.0) == pytest.approx(2 * 3.0 + 2 * 10.0)
    # every rank of a spawned group pays the first-call warm-up again, its ranks sharing the cores; the
    # cp=1 configurations run warm in this process and pay neither
    assert rule(10.0, {2: [zigzag]}, 2, startup=3.0, warmup=2.0) == pytest.approx(5.0 + 5.0)
    assert rule(10.0, {4: [], 2: [zigzag]}, 2, startup=3.0, warmup=2.0) == pytest.approx(5.0 * 4 / 2 + 5.0 + 5.0)
    assert rule(10.0, {1: [ShardPlan.build([8], cp_size=1)]}, 2, startup=3.0, warmup=2.0) == pytest.approx(10.0)
    # by default a spawned rank's warm-up, like its steps, counts RANK_OVERHEAD times this process's
    assert estimate_seconds(10.0, {2: []}, 2, startup=3.0, warmup=2.0) == pytest.approx(3.0 + RANK_OVERHEAD * 2.0)
    assert rule(10.0, {1: [ShardPlan.build([8], cp_size=1)]}, 2, startup=3.0) == pytest.approx(10.0)
    # across ranks the default overhead applies; in the cp=1 process it does not
    assert estimate_seconds(10.0, {2: [zigzag]}, 2, startup=0.0) == pytest.approx(5.0 * RANK_OVERHEAD)
    assert estimate_seconds(10.0, {1: [ShardPlan.build([8], cp_size=1)]}, 2) == pytest.approx(10.0)


def test_duration_text():
    from cpshard.verify import duration_text

    assert [duration_text(s) for s in (0.2, 42.4, 90, 462, 4000)] == ["1 s", "42 s", "1 min 30 s", "7 min 42 s",
                                                                   "1 h 06 min"]
    assert re.fullmatch(r"\d+ s", duration_text(3.5))


# -- the summary and the figure, public -----------------------------------------------------------------------


def test_padding_and_the_summary_functions_are_public():
    import cpshard
    from cpshard import Padding, describe_bshd, describe_plan, draw_plans  # noqa: F401

    assert Padding("minimal") is Padding.MINIMAL and ShardPlan.build([5, 3], cp_size=2, padding=Padding.MINIMAL)
    assert {"Padding", "describe_plan", "describe_bshd", "draw_plans"} <= set(cpshard.__all__)
    assert describe_plan.__doc__ and draw_plans.__doc__ and describe_bshd.__doc__


def test_summary_stays_small_with_many_ranks_and_names_the_busiest():
    from cpshard import describe_plan
    from cpshard.causal import attention_work

    lens = [3000, *([5] * 500), 1]
    plan = ShardPlan.build(lens, cp_size=64, layout="contiguous")
    text = describe_plan(plan)
    work = attention_work(plan)
    busiest = max(range(64), key=work.__getitem__)
    assert len(text) < 6000, len(text)
    rows = [line.split() for line in text.splitlines() if line.strip() and line.split()[0].isdigit()]
    shown = [int(r[0]) for r in rows]
    assert busiest in shown and shown[:6] == list(range(6)) and shown[-2:] == [62, 63] and len(shown) <= 9
    assert all(int(r[4]) == work[int(r[0])] for r in rows)  # the work column is attention_work's
    assert "ranks, 6 .. " in text and "left out" in text
    small = describe_plan(ShardPlan.build(lens, cp_size=16))
    assert "left out" not in small and sum(1 for line in small.splitlines() if line.startswith("rank ")) == 16


# -- what a CLI user can hand it ----------------------------------------------------------------------------

@pytest.mark.parametrize("content, message", [
    (b"\xffgarbage", "is not a text file (byte 0 is b'\\xff')"),
    (b"5\n3\x00\n", "is not a text file (byte 3 is b'\\x00')"),
    (b"x" * 100_000 + b"\n", "line 1 is 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' ... (100000 characters)"),
])
def test_lengths_files_that_are_not_lengths(capsys, tmp_path, content, message):
    path = tmp_path / "lengths.txt"
    path.write_bytes(content)
    err = _refused(capsys, ["plan", "--lengths-file", str(path)])
    assert message in err and len(err) < 1000  # never the whole line back


def test_lengths_file_is_read_with_a_bound(capsys, tmp_path):
    """An endless or huge file is refused after 64 MiB, not read whole; a directory is named."""
    assert "is larger than 64 MiB" in _refused(capsys, ["plan", "--lengths-file", "/dev/zero"])
    assert "is a directory" in _refused(capsys, ["plan", "--lengths-file", str(tmp_path)])


@pytest.mark.parametrize("where", ["missing/x.png", "."])
def test_png_that_cannot_be_written(capsys, tmp_path, where):
    target = str(tmp_path / where)
    assert cli_main(["plan", "--lengths", "5,3", "--png", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cpshard plan: --png={target!r}: cannot be written (") and "Fix: " in err


def test_plan_summary_costs_nothing_per_token(capsys):
    """The summary (runs, balance, work) is per segment: a billion-token sequence plans in a moment
    (it needed ~35 bytes a token: a MemoryError)."""
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert cli_main(["plan", "--lengths", "1000000000,5", "--cp", "4"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 : s0:0-124999999 s0:875000000-999999999" in out
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: far below 1 GB


# -- cpshard pack ---------------------------------------------------------------------------------------------


def test_pack_prints_the_partition_works_and_ratios(capsys):
    from cpshard.pack import pack

    lens = [9000, 300, 7000, 20000, 1200, 4096, 800, 15000]
    argv = ["pack", "--lengths", ",".join(map(str, lens)), "--max-tokens", "32768", "--cp", "8", "--dp", "2",
            "--layout", "contiguous"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    p = pack(lens, max_tokens=32768, cp_size=8, dp_size=2, layout="contiguous")
    # the count and the indices under headers that say which is which (before: indices after "seqs", a count)
    assert "    mb #seqs     rows   /max   slowest rank max/mean  sequence indices  work per CP rank\n" in out
    for d, rank in enumerate(p.micro_batches):
        assert f"DP rank {d}: {len(rank)} micro-batch" in out
        for mb, work in zip(rank, p.work[d]):
            assert f"  {list(mb)}  [" in out and str(max(work)) in out
    assert f"cpshard.pack      {p.step_ratio:.3f}" in out and f"lower bound       {p.lower_bound:.3f}" in out
    assert "verl's partition" in out and "(plain order)" in out and "(reorder=balanced)" in out
    assert re.search(r"cpshard.pack: [+-]\d+\.\d% against verl's partition with reorder=balanced; \+\d+\.\d% above "
                     r"the bound", out)


def test_pack_json_matches_the_library(capsys):
    import json

    from cpshard.compat import verl_partition
    from cpshard.pack import pack

    lens = [37, 5, 64, 12, 90, 3, 41, 77, 18, 60]
    assert cli_main(["pack", "--lengths", ",".join(map(str, lens)), "--max-tokens", "128", "--cp", "2", "--tp", "2",
                     "--dp", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    p = pack(lens, max_tokens=128, cp_size=2, tp_size=2, dp_size=2)
    assert got["micro_batches"] == [[list(mb) for mb in rank] for rank in p.micro_batches]
    assert got["work"] == [[list(w) for w in rank] for rank in p.work]
    assert got["step_ratio"] == p.step_ratio and got["lower_bound"] == p.lower_bound
    assert max(r for rank in got["rows"] for r in rank) <= 128
    assert got["verl"]["micro_batches"] == verl_partition(lens, 2, 128)
    assert got["verl"]["step_ratio_balanced"] is None  # zigzag: no balanced order


def test_pack_summarises_long_batches(capsys, tmp_path):
    import random

    rng = random.Random(3)
    path = tmp_path / "batch.txt"
    path.write_text("\n".join(str(min(8000, max(1, round(rng.expovariate(1 / 2048))))) for _ in range(1200)))
    assert cli_main(["pack", "--lengths-file", str(path), "--max-tokens", "8192", "--cp", "4", "--dp", "12",
                     "--no-verl"]) == 0
    out = capsys.readouterr().out
    assert len(out) < 12000, len(out)
    assert re.search(r"\(\d+ DP ranks, \d+ \.\. \d+, left out\)", out), out
    assert "micro-batches, 8 .. " in out and "(values)" not in out
    assert "verl's partition" not in out


def test_pack_when_verl_cannot_split_the_batch(capsys):
    assert cli_main(["pack", "--lengths", "5,3,8", "--max-tokens", "16", "--dp", "2", "--no-same-count"]) == 0
    assert "verl's partition: not shown (3 sequences do not divide by --dp 2" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--lengths", "4,5,30", "--max-tokens", "24"], "--lengths[2]=30: pads to 32 rows"),
    (["--lengths", "4,5,30", "--max-tokens", "24"],
     "more than --max-tokens=24. Fix: raise --max-tokens to at least 32"),
    (["--lengths", "4,5,6", "--max-tokens", "64", "--min-micro-batches", "4"],
     "Fix: pass more sequences or a smaller --min-micro-batches."),
    (["--lengths", "4,5,6", "--max-tokens", "64", "--group-size", "2"], "--group-size=2: must divide the number"),
    (["--lengths", "4,5,30,9", "--max-tokens", "40", "--group-size", "2"],
     "--lengths[2:4]=[30, 9]: is group 1 (--group-size=2), whose sequences pad to 44 rows"),
])
def test_pack_library_errors_name_flags(capsys, argv, message):
    assert cli_main(["pack", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpshard pack: ") and message in err, err
    assert not any(term in err for term in ("max_tokens", "seqlens", "min_micro_batches", "group_size")), err


def test_pack_group_size_keeps_pairs_together(capsys):
    import json

    from cpshard.pack import pack

    argv = ["pack", "--lengths", "9000,300,7000,20000,1200,4096", "--max-tokens", "32768", "--cp", "4", "--json"]
    assert cli_main([*argv, "--group-size", "2"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = pack([9000, 300, 7000, 20000, 1200, 4096], max_tokens=32768, cp_size=4, group_size=2)
    assert got["micro_batches"] == [[list(mb) for mb in rank] for rank in want.micro_batches]
    assert all({i // 2 for i in mb} == {i // 2 for i in mb if i % 2 == 0} for rank in got["micro_batches"]
               for mb in rank)
    assert got["verl"] is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--lengths", "5,3"], "the following arguments are required: --max-tokens"),
    (["--max-tokens", "0"], "argument --max-tokens: 0 is too small; --max-tokens must be >= 1"),
    (["--max-tokens", "64", "--dp", "-1"], "argument --dp: -1 is too small"),
    (["--max-tokens", "64", "--divisible-by", "x"], "argument --divisible-by: 'x': expected an integer"),
    (["--max-tokens", "64", "--reorder"], "--reorder balances the contiguous layout; add --layout contiguous"),
    (["--max-tokens", "64", "--lengths", "5,-3"], "length 2 is -3"),
])
def test_pack_flag_errors(capsys, argv, message):
    assert message in _refused(capsys, ["pack", *argv])


@pytest.mark.parametrize("argv", [["pack", "--lengths", "5,3,9,2", "--max-tokens", "16", "--dp", "2", "--layout",
                                   "contiguous"], ["plan", "--lengths", "5,3"]])
def test_pack_and_plan_do_not_load_the_communication_layer(argv):
    """Running them, not only importing the CLI (verify's parser, which imports cpshard.verify, is not built)."""
    import subprocess
    import sys

    code = (f"import sys; from cpshard.cli import main; main({argv!r}); print(sorted(m for m in sys.modules if m in "
            "('cpshard.distributed', 'cpshard.attention', 'cpshard.spawn', 'cpshard.verify')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


# -- lengths files as editors and shells write them; the flag the user passed -----------------------

@pytest.mark.parametrize("content", [
    b"\xef\xbb\xbf5\n3\n",            # a UTF-8 byte-order mark (Notepad, PowerShell's Out-File)
    b"5 3\n", b"5\t3", b"5,3\n", b"5, 3\n", b"  5\n\n3  # a comment\n", b"5\r\n3\r\n",
    b"\xef\xbb\xbf[5, 3]",
])
def test_lengths_files_in_every_common_shape(capsys, tmp_path, content):
    path = tmp_path / "lengths.txt"
    path.write_bytes(content)
    assert cli_main(["plan", "--lengths-file", str(path), "--cp", "2"]) == 0
    assert capsys.readouterr().out.startswith("ShardPlan(seqlens=[5, 3], cp_size=2")


def test_lengths_flag_takes_spaces_too(capsys):
    assert cli_main(["plan", "--lengths", "5 3", "--cp", "2"]) == 0  # not "53"
    assert capsys.readouterr().out.startswith("ShardPlan(seqlens=[5, 3], cp_size=2")
    assert "'5,,3': expected comma-separated ints" in _refused(capsys, ["plan", "--lengths", "5,,3"])


@pytest.mark.parametrize("command", [["plan"], ["pack", "--max-tokens", "64"], ["verify", "--no-progress"]])
@pytest.mark.parametrize("content", [b"", b"\n\n# only a comment\n", b"\xef\xbb\xbf", b"[]"])
def test_an_empty_lengths_file_is_named_by_its_flag(capsys, tmp_path, command, content):
    path = tmp_path / "empty.txt"
    path.write_bytes(content)
    line = _refused(capsys, [command[0], "--lengths-file", str(path), *command[1:]])
    assert f"--lengths-file {path}: holds no lengths" in line and "--lengths=" not in line, line


def test_library_errors_name_the_lengths_file_flag(capsys, tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("5\n3\n")
    assert cli_main(["pack", "--lengths-file", str(path), "--dp", "3", "--max-tokens", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpshard pack: --lengths-file=2 sequences: cannot fill 3 micro-batches"), err


@pytest.mark.parametrize(("argv", "fix"), [
    # three DP ranks, two sequences: no budget gives a DP rank no micro-batch
    (["--lengths", "5,3", "--dp", "3", "--max-tokens", "64"], "Fix: pass more sequences or a smaller --dp."),
    (["--lengths", "5,3,4", "--dp", "3", "--min-micro-batches", "2", "--max-tokens", "64"],
     "Fix: pass more sequences, a smaller --dp or a smaller --min-micro-batches."),
    (["--lengths", "5,3,4", "--divisible-by", "4", "--max-tokens", "64"],
     "Fix: pass more sequences or a smaller --divisible-by."),
    # three sequences that each fill a micro-batch: two per DP rank are needed, one each would do with a
    # larger budget, and unequal counts (2 + 1) would do too
    (["--lengths", "50,30,40", "--dp", "2", "--max-tokens", "52"],
     "Fix: pass more sequences, a smaller --dp, --no-same-count or a larger --max-tokens."),
])
def test_pack_suggests_only_what_can_help(capsys, argv, fix):
    assert cli_main(["pack", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(fix), err


def test_estimate_start_up_is_not_the_time_a_process_waited():
    """A rank's start-up is estimated from the CPU time this process spent starting (importing torch),
    not from its age: a process that waited before importing cpshard.verify (an interactive session, a
    notebook) gets the same estimate (its age once counted per rank: minutes for a run of seconds)."""
    import subprocess
    import sys

    code = ("import time, sys; time.sleep(float(sys.argv[1]))\n"
            "from cpshard import ShardPlan\nfrom cpshard.verify import estimate_seconds\n"
            "print(estimate_seconds(0.0, {4: [ShardPlan.build([8], cp_size=4)]}, 4))")
    fresh, waited = (float(subprocess.run([sys.executable, "-c", code, wait], capture_output=True, text=True,
                                          timeout=120, check=True).stdout) for wait in ("0", "8"))
    # one rank's start-up: 1 .. 15 s of import and 1 s more, RANK_OVERHEAD times (ranks start together)
    assert 2.0 * RANK_OVERHEAD <= fresh <= 16.0 * RANK_OVERHEAD and 2.0 * RANK_OVERHEAD <= waited <= 16 * RANK_OVERHEAD
    assert waited < fresh + 4.0, (fresh, waited)


def test_reference_is_timed_warm_and_the_estimate_follows():
    """The cp=1 step of the batch runs after a 2-token step that pays the first-call costs; the bar shows
    the batch's step and the estimate."""
    import io

    from cpshard.verify import Progress, timed_reference

    calls = []
    stream = io.StringIO()

    class Bar(Progress):
        def note(self, text, stream_=None):
            super().note(text, stream)

        def step(self, label, stream_=None):
            super().step(label, stream)

    got = timed_reference(lambda lens: calls.append(lens) or len(calls), (5, 3),
                          {2: [ShardPlan.build([5, 3], cp_size=2)]}, Bar(total=3))
    assert calls == [(2,), (5, 3)] and got == 2
    lines = stream.getvalue().splitlines()
    assert lines[0] == "cpshard verify: 8 tokens, 1 configurations; the cp=1 reference step first, then the estimate"
    assert re.fullmatch(r"cpshard verify \[#+\.*\] 1/3 cp=1 reference \d+\.\d s", lines[1]), lines
    assert re.fullmatch(r"cpshard verify: about \d+ s more on \d+ CPU cores? \(.*warm-up.*\)", lines[2]), lines


@pytest.mark.parametrize(("flags", "message"), [
    (["--layouts", "zigzag"], "--layouts does not apply to --model hybrid: its attention runs on zigzag"),
    (["--attention", "naive"], "--attention does not apply to --model hybrid: its attention is the reference"),
    (["--attention", "reference"], "--attention does not apply to --model hybrid"),
    (["--reorder"], "--reorder does not apply to --model hybrid: it runs both orders of its contiguous twin"),
])
def test_hybrid_refuses_the_decoders_flags(capsys, flags, message):
    line = _refused(capsys, ["verify", "--model", "hybrid", *flags, "--no-progress"])
    assert message in line and line.endswith(f"drop {flags[0]}"), line


def test_hybrid_library_refuses_layouts_and_attention():
    from cpshard.verify import verify

    with pytest.raises(ValueError, match=r"attention='naive': does not apply to model='hybrid'"):
        verify([9, 4], model="hybrid", attention="naive", progress=False)
    with pytest.raises(ValueError, match=r"layouts=\['contiguous'\]: does not apply to model='hybrid'"):
        verify([9, 4], model="hybrid", layouts=["contiguous"], progress=False)
