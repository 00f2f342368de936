"""``cpshard verify`` and the ``cpshard plan`` additions (lengths files, the summary, ``--png``).

The spawned runs are small (three short sequences, one tp) to keep the suite fast on two cores:
one passing run with --json, one with the layout-naive attention (must fail), one under torchrun.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import struct
import subprocess
import sys

import pytest
import torch

from cpshard import ShardPlan
from cpshard.cli import main as cli_main
from cpshard.spawn import free_port
from cpshard.verify import Config, Progress, compare, reference, step

SMALL = ["--lengths", "9,1,4", "--cp", "2"]
KEYS = {"cp", "tp", "layout", "ok", "max_abs_diff", "padding_overhead", "attention_imbalance", "seconds"}
DIFFS = {"loss", "logprobs", "grads", "mtp_loss"}


def _one_json_object(text: str) -> dict:
    decoder = json.JSONDecoder()
    obj, end = decoder.raw_decode(text.strip())
    assert text.strip()[end:] == "", "more than one JSON object printed"
    assert isinstance(obj, dict)
    return obj


def _check_schema(report: dict) -> None:
    assert {"ok", "naive_kernel_caught", "results"} <= set(report)
    for r in report["results"]:
        assert KEYS <= set(r) and set(r["max_abs_diff"]) == DIFFS, r
        assert isinstance(r["cp"], int) and isinstance(r["ok"], bool) and isinstance(r["seconds"], float)


def test_verify_json_passes_and_reports_every_configuration(capfd):
    assert cli_main(["verify", *SMALL, "--tp", "1,2", "--padding", "aligned,minimal", "--json"]) == 0
    out, err = capfd.readouterr()
    report = _one_json_object(out)
    _check_schema(report)
    assert report["ok"] is True and report["naive_kernel_caught"] is True
    assert [(r["cp"], r["tp"], r["layout"], r["padding"]) for r in report["results"]] == [
        (2, tp, layout, padding) for tp in (1, 2) for layout in ("zigzag", "contiguous")
        for padding in ("aligned", "minimal")]
    for r in report["results"]:
        assert r["ok"] and max(r["max_abs_diff"].values()) < 1e-12, r
        assert r["padding_overhead"] >= 0 and r["attention_imbalance"] >= 1.0
    by = {(r["tp"], r["layout"], r["padding"]): r["padding_overhead"] for r in report["results"]}
    assert by[2, "zigzag", "aligned"] > by[2, "zigzag", "minimal"] > 0  # 9,1,4 padded to 16,8,8 vs to 12,4,4
    assert report["naive"]["ok"] is False and report["naive"]["max_abs_diff"]["logprobs"] > 1e-3
    assert "10/10" in err  # the progress bar: the reference, eight configurations, the naive check
    # the estimate before the configurations, and each step's time on its line
    assert re.search(r"cpshard verify: about \d+ (s|min \d\d s) more on \d+ CPU cores?", err), err
    assert re.search(r"\] 1/10 cp=1 reference \d+\.\d s\n", err) and re.search(
        r"\] 10/10 cp=2 tp=1 zigzag, naive attention \d+\.\d s\n", err), err


def test_naive_attention_under_zigzag_is_a_mismatch_with_nonzero_exit(capfd):
    assert cli_main(["verify", *SMALL, "--tp", "1", "--attention", "naive", "--no-progress"]) == 1
    out, _ = capfd.readouterr()
    assert "cp=2 tp=1 zigzag, naive attention" in out and "MISMATCH" in out
    assert "FAILED: cp=2 tp=1 zigzag, naive attention differs from cp=1" in out
    rows = {line.split("  ")[0]: line for line in out.splitlines() if line.startswith("cp=2")}
    assert rows["cp=2 tp=1 contiguous, naive attention"].endswith(" ok")  # right where its belief holds


def test_torchrun_path_on_two_gloo_ranks():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "cpshard", "verify", "--backend", "gloo", "--lengths", "9,1,4",
           "--tp", "1", "--reorder", "--json", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _one_json_object(proc.stdout)  # rank 0 alone reports
    _check_schema(report)
    assert report["ok"] and report["naive_kernel_caught"]
    assert [(r["cp"], r["layout"], r["reorder"], r["ok"]) for r in report["results"]] == [
        (2, "zigzag", None, True), (2, "contiguous", None, True), (2, "contiguous", "balanced", True)]


def test_verify_refuses_bad_arguments(capfd):
    from cpshard.verify import verify

    with pytest.raises(ValueError, match=r"lengths=\[0, 1\]: must hold a sequence of at least 2 tokens"):
        verify(lengths=[0, 1], progress=False)
    with pytest.raises(ValueError, match="is not a known layout"):
        verify(layouts=["zigzog"], progress=False)
    with pytest.raises(SystemExit):
        cli_main(["verify", "--lengths", "0,1", "--no-progress"])
    assert "argument --lengths: no sequence has 2 tokens" in capfd.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["verify", "--backend", "nccl"])
    assert "--backend applies under torchrun only" in capfd.readouterr().err


# -- in one process: the step, the comparison, the progress bar --------------------------------------


def test_cp1_with_tp_padding_equals_reference_and_comparison_can_fail():
    lens = (9, 1, 4)
    want = reference(lens, torch.float64)
    config = Config(1, 2, "zigzag")
    from cpshard.verify import TinyDecoder, token_batch

    plan = ShardPlan.build(lens, cp_size=1, tp_size=2)
    got = step(TinyDecoder(), token_batch(lens), plan, 0, None)
    result = compare(config, got, want, plan, 1e-9)
    assert result.ok and max(result.max_abs_diff.values()) < 1e-13
    assert result.attention_work == [45 + 1 + 10]
    broken = got.grads["layers.0.qkv.weight"].clone()
    broken[0, 0] += 1e-6
    bad = compare(config, type(got)(got.loss, got.logprobs, got.mtp_loss, {**got.grads, "layers.0.qkv.weight": broken},
                                    got.seconds), want, plan, 1e-9)
    assert not bad.ok and bad.max_abs_diff["grads"] == pytest.approx(1e-6, rel=1e-6)


def test_progress_bar_lines():
    import io

    stream = io.StringIO()
    bar = Progress(total=2, width=4)
    bar.step("a", stream)
    bar.step("b", stream)
    assert stream.getvalue().splitlines() == ["cpshard verify [##..] 1/2 a", "cpshard verify [####] 2/2 b"]


# -- cpshard plan additions -------------------------------------------------------------------------


SPEC_EXAMPLE = [
    "global : s0p0 s0p1 s0p2 s0p3 s0p4 pad  pad  pad  | s1p0 s1p1 s1p2 pad",
    "rank 0 : s0p0 s0p1 | pad  pad  | s1p0 | pad",
    "rank 1 : s0p2 s0p3 | s0p4 pad  | s1p1 | s1p2",
]


def test_plan_prints_spec_worked_example_from_every_lengths_source(capsys, tmp_path):
    lines, listed = tmp_path / "lengths.txt", tmp_path / "lengths.json"
    lines.write_text("# lengths of SPEC's worked example\n5\n\n3\n")
    listed.write_text("[5, 3]")
    for argv in (["--lengths", "5,3"], ["--lengths-file", str(lines)], ["--lengths-file", str(listed)]):
        assert cli_main(["plan", *argv, "--cp", "2"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert [line for line in out if line.startswith(("global", "rank 0 :", "rank 1 :"))] == SPEC_EXAMPLE, argv


def test_plan_lengths_file_errors(capsys, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("5\nfive\n")
    with pytest.raises(SystemExit):
        cli_main(["plan", "--lengths-file", str(bad)])
    assert "line 2 is 'five'" in capsys.readouterr().err
    good = tmp_path / "good.txt"
    good.write_text("5\n")
    with pytest.raises(SystemExit):
        cli_main(["plan", "--lengths", "5", "--lengths-file", str(good)])
    assert "not allowed with argument" in capsys.readouterr().err


def test_plan_summary_for_long_batches_and_both_layouts(capsys):
    assert cli_main(["plan", "--lengths", "300,17,1,1200", "--cp", "4", "--layout", "both"]) == 0
    out = capsys.readouterr().out
    assert out.count("picture omitted") == 2 and "layout='zigzag'" in out and "layout='contiguous'" in out
    zigzag, contiguous = out.split("layout='contiguous'")
    assert "rank 3 : s0:114-189 s1:9-14 s2:3-4 s3:450-749\n" in zigzag  # the two middle chunks, one run
    assert "rank 0 : s0:0-299 s1:0-19 s2:0-3 s3:0-56\nrank 1 : s3:57-437\n" in contiguous


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plan_png(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional [plot] extra; the test extra installs it")
    one, both = tmp_path / "zigzag.png", tmp_path / "both.png"
    assert cli_main(["plan", "--lengths", "300,17,1,5,1200", "--cp", "4", "--png", str(one)]) == 0
    assert cli_main(["plan", "--lengths", "300,17,1,5,1200", "--cp", "4", "--layout", "both", "--png", str(both)]) == 0
    assert f"wrote {both}" in capsys.readouterr().out
    (w1, h1), (w2, h2) = _png_size(one.read_bytes()), _png_size(both.read_bytes())
    assert w1 >= 600 and h1 >= 300 and h2 == h1 and w2 > 1.8 * w1  # side by side
    assert one.stat().st_size > 10_000


def test_plan_png_refused_with_bshd(capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli_main(["plan", "--bshd", "--png", str(tmp_path / "x.png")])
    assert "--png does not apply with --bshd" in capsys.readouterr().err


def test_scripts_run_sh_runs_verify():
    text = (pathlib.Path(__file__).resolve().parents[1] / "scripts" / "run.sh").read_text()
    assert "cpshard verify" in text


def test_the_docs_show_the_default_run():
    """docs/verify.md's `cpshard verify` block lists the default configurations with their true padding and balance."""
    from cpshard.causal import attention_work
    from cpshard.verify import DEFAULT_LENGTHS, configurations

    readme = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "verify.md").read_text()
    block = readme.split("$ cpshard verify\n", 1)[1].split("```", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("cp=")]
    configs = configurations((2, 4), (1, 2), ("zigzag", "contiguous")) + [Config(2, 1, "zigzag", "naive")]
    assert [row.split("  ")[0] for row in rows] == [c.name for c in configs]
    for row, c in zip(rows, configs):
        plan = ShardPlan.build(DEFAULT_LENGTHS, cp_size=c.cp, tp_size=c.tp, layout=c.layout)
        work = attention_work(plan)
        assert f"{100 * plan.padding_overhead:.1f}%" in row and f"{max(work) * len(work) / sum(work):.3f}" in row
    assert block.rstrip().endswith("OK: every configuration equals cp=1, and the layout-naive attention under "
                                   "zigzag was caught")


def test_configurations_take_reorder_values():
    from cpshard.verify import configurations, verify

    got = [(c.cp, c.layout, c.padding, c.reorder)
           for c in configurations((1, 2), (1,), ("zigzag", "contiguous"), ("aligned", "minimal"), (None, "balanced"))]
    assert got == [(1, "zigzag", "aligned", None), (1, "zigzag", "minimal", None),
                   (2, "zigzag", "aligned", None), (2, "zigzag", "minimal", None),
                   (2, "contiguous", "aligned", None), (2, "contiguous", "aligned", "balanced"),
                   (2, "contiguous", "minimal", None), (2, "contiguous", "minimal", "balanced")]
    for bad in (True, "balanced", (), ("random",)):
        with pytest.raises(ValueError, match="reorders"):
            verify(reorders=bad, progress=False)


def test_the_smallest_batch_runs_and_says_why_the_naive_check_cannot_show_anything(capfd):
    """``verify --lengths 2,1 --cp 2 --tp 2 --layouts zigzag``: before, a rank of pad rows skipped the
    attention's backward all_reduce (one rank killed by SIGABRT; ``--model hybrid`` waited out the
    60 s timeout), and the layout-naive attention, equal to the right one on this batch, was
    reported "not caught" (exit 1). Now every configuration runs, and the naive check is skipped up
    front, naming why (``--model hybrid`` is the same: tests/test_scan.py)."""
    from cpshard.verify import naive_shown

    assert not naive_shown(ShardPlan.build([2, 1], cp_size=2))  # no labelled row sees other keys
    assert naive_shown(ShardPlan.build([9, 1, 4], cp_size=2))
    assert cli_main(["verify", "--lengths", "2,1", "--cp", "2", "--tp", "2", "--layouts", "zigzag", "--json"]) == 0
    out, err = capfd.readouterr()
    report = _one_json_object(out)
    assert report["ok"] is True and report["naive_kernel_caught"] is False and report["naive"] is None
    assert report["naive_skipped"].startswith("the layout-naive attention under zigzag is not run: on this batch at "
                                              "cp=2 it computes every labelled token exactly as the right one does")
    assert [r["ok"] for r in report["results"]] == [True]
    assert report["naive_skipped"] in err  # said before the run, not after


def test_hybrid_takes_padding_and_reports_every_quantity(capfd):
    """--model hybrid --padding aligned runs aligned padding only (both twin orders); its MTP depths are
    compared like the decoder's, so the layout-naive scan's row shows a real MTP difference; the estimate
    comes after the cp=1 step, as for the decoder."""
    assert cli_main(["verify", "--model", "hybrid", *SMALL, "--tp", "2", "--padding", "aligned", "--json"]) == 0
    out, err = capfd.readouterr()
    report = _one_json_object(out)
    _check_schema(report)
    assert report["model"] == "hybrid" and report["ok"] and report["naive_kernel_caught"]
    assert [(r["cp"], r["tp"], r["padding"], r["reorder"]) for r in report["results"]] == [
        (2, 2, "aligned", None), (2, 2, "aligned", "balanced")]
    for r in report["results"]:
        assert max(r["max_abs_diff"].values()) < 1e-12, r
    naive = report["naive"]
    assert (naive["tp"], naive["padding"]) == (2, "aligned")  # the naive check at the --tp asked for
    assert naive["max_abs_diff"]["mtp_loss"] > 1e-3 and naive["max_abs_diff"]["logprobs"] > 1e-3, naive
    assert re.search(r"\] 1/4 cp=1 reference \d+\.\d s\ncpshard verify: about \d+ (s|min \d\d s) more on \d+ CPU "
                     r"cores?", err), err


def test_naive_attention_check_runs_at_the_tp_asked_for(capfd):
    assert cli_main(["verify", *SMALL, "--tp", "2", "--layouts", "zigzag", "--json", "--no-progress"]) == 0
    report = _one_json_object(capfd.readouterr().out)
    assert [(r["tp"], r["layout"], r["ok"]) for r in report["results"]] == [(2, "zigzag", True)]
    assert (report["naive"]["tp"], report["naive"]["attention"], report["naive"]["ok"]) == (2, "naive", False)


def test_a_long_batch_is_summarised_in_the_table():
    """`verify --scale-to` of 2,000 lengths printed every one on the table's first line (about 6 KB); past
    16 lengths the line gives their count, min, median, max and total instead."""
    from cpshard.verify import Report, format_table

    short = format_table(Report([], None, (97, 23, 1), "float64", 1e-9, 1.0, naive_skipped="skipped"))
    assert short.startswith("lengths [97, 23, 1], float64, max |difference| from cp=1")
    lens = tuple([1, 2, 3, 4, 210] * 400)
    table = format_table(Report([], None, lens, "float64", 1e-9, 1.0, naive_skipped="skipped"))
    first = table.splitlines()[0]
    assert first.startswith(f"2000 lengths (min 1, median 3, max 210; {sum(lens)} tokens), float64, max |difference|")
    assert len(first) < 200


def test_a_run_at_cp_1_alone_starts_no_ranks(monkeypatch):
    """`verify --cp 1` ran a cp=2 layout-naive row as well; now the naive check is skipped, saying why,
    and no rank is started."""
    from cpshard.verify import verify

    def no_ranks(*args, **kwargs):
        raise AssertionError("verify started ranks at --cp 1")

    monkeypatch.setattr("cpshard.tools.verify.run_ranks", no_ranks)
    report = verify([9, 1, 4], cps=[1], tps=[1], layouts=["zigzag"], progress=False)
    assert report.ok and [r.config.cp for r in report.results] == [1] and report.naive is None
    assert report.naive_skipped == ("the layout-naive attention under zigzag is not run: it can only be wrong across "
                                    "ranks, and no cp above 1 was asked for; add one, e.g. --cp 1,2, to see it caught")
