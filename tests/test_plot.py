"""``cpshard plan --png`` stays readable from 2 to thousands of sequences (matplotlib: the [plot] extra,
which the test extra installs).

The figure's rank map is read back from the PNG: no rank colour (tab10, or tab10 faded towards white)
has all three channels below 0.25, so a near-black pixel inside the map can only be a sequence
boundary line. At 512 sequences the boundaries go to a strip above the map and the map must be
(almost) free of them: at most 1% of its pixels near black, where 513 lines of one pixel each across
a ~700-pixel-wide map would blacken all of it. At 2 sequences the one boundary is a line, and must
show (a check that the measure sees lines at all).
"""

from __future__ import annotations

import random

import pytest

from cpshard import ShardPlan, draw_plans
from cpshard.cli import main as cli_main

mpl_image = pytest.importorskip("matplotlib.image", reason="matplotlib is the optional [plot] extra; the test "
                                "extra installs it")
NEAR_BLACK = 0.25


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 2000) for _ in range(n)]


def _in_rank_maps(fig, path, which) -> list[float]:
    """Per rank map, the fraction of its pixels (inside the frame) for which ``which(rgb)`` holds."""
    image = mpl_image.imread(str(path))[..., :3]
    height = image.shape[0]
    out = []
    for ax in [a for a in fig.axes if a.get_label() == "rank map"]:
        box = ax.get_window_extent()
        x0, x1 = int(box.x0) + 3, int(box.x1) - 3  # inside the frame's lines
        y0, y1 = height - int(box.y1) + 3, height - int(box.y0) - 3
        region = image[y0:y1, x0:x1]
        assert region.size > 100 * 100 * 3, region.shape
        out.append(float(which(region).mean()))
    return out


def _near_black_in_rank_maps(fig, path) -> list[float]:
    """Per rank map, the fraction of its pixels (inside the frame) with every channel below NEAR_BLACK."""
    return _in_rank_maps(fig, path, lambda region: (region < NEAR_BLACK).all(-1))


def test_rank_map_not_covered_by_boundaries_at_512_sequences(tmp_path):
    lens = _lengths(512)
    plans = [ShardPlan.build(lens, cp_size=8, tp_size=4, layout=layout) for layout in ("zigzag", "contiguous")]
    path = tmp_path / "512.png"
    fig = draw_plans(plans, str(path))
    fractions = _near_black_in_rank_maps(fig, path)
    assert len(fractions) == 2 and max(fractions) <= 0.01, fractions
    assert any(a.get_ylabel() == "seqs" for a in fig.axes)  # the boundaries are in the strip instead


def test_boundary_lines_show_at_two_sequences(tmp_path):
    path = tmp_path / "2.png"
    fig = draw_plans([ShardPlan.build([5, 3], cp_size=2)], str(path))
    (fraction,) = _near_black_in_rank_maps(fig, path)
    assert fraction > 0.001, fraction  # one line of ~1 px across a ~600 px map
    assert not any(a.get_ylabel() == "seqs" for a in fig.axes)


def test_work_panels_share_one_scale_and_titles_name_every_option(tmp_path):
    lens = _lengths(64, seed=1)
    plans = [ShardPlan.build(lens, cp_size=8, tp_size=4, layout="zigzag", padding="minimal"),
             ShardPlan.build(lens, cp_size=8, tp_size=4, layout="contiguous", reorder="balanced", fp8=True)]
    fig = draw_plans(plans, str(tmp_path / "64.png"), notes="min_local_rows=8")
    work = [a for a in fig.axes if a.get_ylabel().startswith("causal work")]
    assert len(work) == 2 and work[0].get_ylim() == work[1].get_ylim()
    titles = " | ".join(a.get_title() for a in fig.axes)
    for text in ("zigzag, cp=8, tp=4, padding=minimal", "no reorder", "contiguous, cp=8, tp=4, padding=aligned",
                 "fp8", "reorder=balanced", "min_local_rows=8", "64 sequences"):
        assert text in titles, (text, titles)


def test_plan_png_from_the_cli_at_scale(capsys, tmp_path):
    path = tmp_path / "both.png"
    lengths = ",".join(map(str, _lengths(2048, seed=2)))
    assert cli_main(["plan", "--lengths", lengths, "--cp", "8", "--tp", "4", "--layout", "both",
                     "--length-bucket", "64", "--png", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}" in out and len(out) < 8000  # the text stays small too
    image = mpl_image.imread(str(path))
    assert image.shape[1] >= 1300 and 450 <= image.shape[0] <= 700, image.shape


def test_pack_png_draws_every_micro_batch_on_one_scale(tmp_path):
    from matplotlib.collections import PolyCollection

    from cpshard import pack
    from cpshard.plot import draw_packing

    lens = _lengths(200, seed=4)
    p = pack(lens, max_tokens=8192, cp_size=4, dp_size=2, layout="contiguous")
    other = [[[sum(w)] * 4 for w in rank] for rank in p.work]  # any works of the same shape
    fig = draw_packing(p, str(tmp_path / "pack.png"), others=[("other", other)])
    lanes = [a for a in fig.axes if a.get_label() == "timeline"]
    assert len(lanes) == 2 and lanes[0].get_xlim() == lanes[1].get_xlim()
    boxes = [c for c in lanes[0].collections if isinstance(c, PolyCollection)]
    assert len(boxes) == 2 * sum(p.num_micro_batches)  # each micro-batch: its time and its mean share
    assert f"step ratio {p.step_ratio:.3f}" in lanes[0].get_title()
    assert mpl_image.imread(str(tmp_path / "pack.png")).shape[1] >= 700


def test_pack_png_from_the_cli(capsys, tmp_path):
    path = tmp_path / "pack.png"
    lengths = ",".join(map(str, _lengths(300, seed=5)))
    assert cli_main(["pack", "--lengths", lengths, "--max-tokens", "16384", "--cp", "8", "--dp", "2", "--layout",
                     "contiguous", "--png", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out and path.stat().st_size > 10_000
    assert cli_main(["pack", "--lengths", "5,3", "--max-tokens", "16", "--png", str(tmp_path / "no" / "x.png")]) == 2
    assert "cannot be written" in capsys.readouterr().err


def _white_in_rank_maps(fig, path) -> list[float]:
    """Per rank map, the fraction of its pixels (inside the frame) that are white: no rank holds the rows."""
    return _in_rank_maps(fig, path, lambda region: (region > 0.97).all(-1))


@pytest.mark.parametrize("count", [320, 2000])
def test_zigzag_map_stays_readable_at_hundreds_of_sequences(tmp_path, count):
    """Under zigzag every rank holds its share of every sequence: each rank's band is in full colour, not
    the barcode of chunks narrower than a pixel column; the contiguous map stays a staircase (each rank
    holds a quarter of the buffer: three quarters of its band white)."""
    lens = _lengths(count, seed=7)
    plans = [ShardPlan.build(lens, cp_size=4, layout=layout) for layout in ("zigzag", "contiguous")]
    path = tmp_path / "map.png"
    zigzag, contiguous = _white_in_rank_maps(draw_plans(plans, str(path)), path)
    assert zigzag <= 0.01, zigzag
    assert 0.70 <= contiguous <= 0.80, contiguous


def test_long_sequences_keep_their_chunks(tmp_path):
    """Sequences whose chunks span many columns are drawn row by row: one zigzag sequence of 4096 rows at
    cp=2 shows rank 0 on its first and last quarter only (half of its band white)."""
    path = tmp_path / "one.png"
    (white,) = _white_in_rank_maps(draw_plans([ShardPlan.build([4096], cp_size=2)], str(path)), path)
    assert 0.45 <= white <= 0.55, white


def test_pack_png_axis_reads_in_units_and_micro_batches_are_labelled(tmp_path):
    from cpshard import pack
    from cpshard.plot import draw_packing

    p = pack([9000, 300, 7000, 20000, 1200, 4096], max_tokens=32768, cp_size=2)
    fig = draw_packing(p, str(tmp_path / "pack.png"), others=[("other", [list(rank) for rank in p.work])])
    for lane in [a for a in fig.axes if a.get_label() == "timeline"]:
        assert lane.xaxis.get_offset_text().get_text() == ""  # no "1e8" in the corner
        ticks = [t.get_text() for t in lane.get_xticklabels()]
        assert ticks[0] == "0" and all(t.endswith("M") for t in ticks[1:] if t), ticks
    first, other = [a for a in fig.axes if a.get_label() == "timeline"]
    want = {f"mb {m}: {len(mb)} seq{'s' if len(mb) > 1 else ''}" for m, mb in enumerate(p.micro_batches[0])}
    assert {t.get_text() for t in first.texts} == want and len(want) == p.num_micro_batches[0] > 1
    assert {t.get_text() for t in other.texts} == {f"mb {m}" for m in range(p.num_micro_batches[0])}


def test_micro_batch_labels_shrink_to_fit():
    from cpshard.plot import micro_batch_label

    assert micro_batch_label(3, 12, 200) == "mb 3: 12 seqs" and micro_batch_label(0, 1, 200) == "mb 0: 1 seq"
    assert micro_batch_label(3, 12, 30) == "mb 3" and micro_batch_label(3, 12, 15) == "3"
    assert micro_batch_label(3, None, 200) == "mb 3" and micro_batch_label(3, 12, 5) == ""
