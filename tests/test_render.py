"""Pictures of block maps and masks: text art, SVG, matplotlib, `maskc.show`, `maskc show`."""

import builtins
import sys
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskc
from maskc.compiled import render

SVG = "{http://www.w3.org/2000/svg}"

CAUSAL_512 = """\
causal
shape    512 × 512 (q × k), q_offset 0
tiles    128 × 128 → 4 × 4 tiles
density  62.5% of tiles visited: full 6 · partial 4 · empty 6
FLOPs    37.5% saved vs dense
legend   █ full  ░ partial  · empty
cells    one per tile

  q \\ k  0   256
  0:128  ░░······
128:256  ██░░····
256:384  ████░░··
384:512  ██████░░
"""

CAUSAL_8_TILES_4 = """\
causal
shape    16 × 16 (q × k), q_offset 0
tiles    4 × 4 → 4 × 4 tiles
density  62.5% of tiles visited: full 6 · partial 4 · empty 6
FLOPs    37.5% saved vs dense
legend   # full  + partial  . empty
cells    2 × 2 tiles (8 × 8 tokens) each; a mixed cell is drawn partial

q \\ k  0 8
 0:8  ++..
8:16  ##++
"""

SHOW_CAUSAL_4 = """\
causal
shape    4 × 4 (q × k), q_offset 0
tiles    2 × 2 → 2 × 2 tiles
density  75.0% of tiles visited: full 1 · partial 2 · empty 1
FLOPs    25.0% saved vs dense
legend   █ allowed, full tile   ▓ allowed, partial tile   · masked, partial tile   blank: empty tile

q \\ k  0  2
      ┌──┬──┐
    0 │▓·│  │
    1 │▓▓│  │
      ├──┼──┤
    2 │██│▓·│
    3 │██│▓▓│
      └──┴──┘
"""


def _image(n, spans):
  img = np.zeros(n, np.int64)
  for a, z in spans:
    img[a:z] = 1
  return img


def _maps():
  """Small maps covering one mask, heads, a batch, ragged lengths and an offset."""
  img = np.stack([_image(300, [(40, 90)]), _image(300, [(100, 260)])])
  return [
      maskc.compile("causal", 512, block_q=128, block_kv=128),
      maskc.compile("sliding(100) | sink(7)", 1000, block_q=64, block_kv=32),
      maskc.compile("causal & chunk(64)", 200, 700, block_q=16, block_kv=48),
      maskc.compile(["causal", "sliding(64)", "causal"], 256, block_q=32, block_kv=32),
      maskc.compile(["causal | bidirectional(img)", "sliding(50)"], 300, block_q=32, block_kv=32,
                    operands={"img": img}),
  ]


def _coarse(grid, rq, ck):
  """The documented downsampling rule, element by element, from the dense tile grid."""
  n_q, n_k = grid.shape
  out = np.zeros((-(-n_q // rq), -(-n_k // ck)), np.int8)
  for i in range(out.shape[0]):
    for j in range(out.shape[1]):
      block = grid[i * rq:(i + 1) * rq, j * ck:(j + 1) * ck]
      out[i, j] = 2 if (block == 2).all() else 0 if (block == 0).all() else 1
  return out


def _panel_grid(bm, panel):
  g = np.asarray(bm.grid)
  idx = ()
  if bm.batch is not None:
    idx += (panel.batch,)
  if panel.heads is not None:
    idx += (panel.heads[0],)
  return g[idx]


# ----------------------------------------------------------------------------- text


def test_text_of_causal_512_is_exact():
  bm = maskc.compile("causal", 512, block_q=128, block_kv=128)
  assert render.render_text(bm) == CAUSAL_512
  assert bm.to_text() == CAUSAL_512


def test_text_downsamples_to_width_with_ascii():
  bm = maskc.compile("causal", 16, block_q=4, block_kv=4)
  assert render.render_text(bm, width=13, ascii=True) == CAUSAL_8_TILES_4


@pytest.mark.parametrize("bm", _maps(), ids=lambda bm: repr(bm.masks))
def test_stats_match_the_grid(bm):
  st = render.stats(bm)
  assert {k: st[k] for k in ("empty", "partial", "full")} == bm.counts
  assert st["density"] == pytest.approx(bm.density)
  assert st["flops_saved"] == pytest.approx(bm.flops_saved)


@pytest.mark.parametrize("bm", _maps(), ids=lambda bm: repr(bm.masks))
@pytest.mark.parametrize("rq,ck", [(1, 1), (2, 4), (4, 1), (8, 8), (64, 64)])
def test_cells_follow_the_downsampling_rule(bm, rq, ck):
  for panel in render.panels(bm):
    pic = render.picture(bm, panel, rq, ck)
    np.testing.assert_array_equal(pic.cells, _coarse(_panel_grid(bm, panel), rq, ck))
    assert pic.row_edges[0] == 0 and pic.row_edges[-1] == bm.q_len
    assert pic.col_edges[0] == 0 and pic.col_edges[-1] == bm.kv_len


def test_panels_group_heads_sharing_a_mask_and_batch_rows():
  bm = _maps()[4]
  titles = [p.title for p in render.panels(bm)]
  assert titles == ["batch 0 · head 0: causal | bidirectional(img)",
                    "batch 0 · head 1: sliding(50)",
                    "batch 1 · head 0: causal | bidirectional(img)",
                    "batch 1 · head 1: sliding(50)"]
  heads = render.panels(_maps()[3])
  assert [p.heads for p in heads] == [(0, 2), (1,)]
  text = _maps()[3].to_text()
  assert "heads 0, 2: causal" in text and "head 1: sliding(64)" in text
  assert "panels   heads 3 (2 distinct masks)" in text


def test_panel_count_is_capped_and_said():
  bm = maskc.compile([f"sliding({w})" for w in range(1, 13)], 64, block_q=16, block_kv=16)
  text = render.render_text(bm, max_panels=3)
  assert text.count(": sliding(") == 3
  assert "… 9 more panels not shown (max_panels=3)" in text
  svg = render.render_svg(bm, max_panels=3)
  assert "9 more panels not shown" in svg


def test_row_labels_use_positions_with_offset():
  bm = maskc.compile("causal", 256, 1024, block_q=128, block_kv=128)
  lines = bm.to_text().splitlines()
  assert "q_offset 768" in lines[1]
  assert lines[-2].lstrip().startswith("768:896")
  assert lines[-1].lstrip().startswith("896:1K")


def test_huge_map_renders_small_without_building_the_grid(monkeypatch):
  from maskc.compiled import blockmap as _blockmap, tiles as _tiles

  def no_grid(*args, **kwargs):
    raise AssertionError("the 64 MB tile grid was built")

  monkeypatch.setattr(_blockmap, "grid_from_runs", no_grid)
  monkeypatch.setattr(_tiles, "grid_from_runs", no_grid)
  bm = maskc.compile("causal & chunk(8192)", 1 << 20, block_q=128, block_kv=128)
  text = bm.to_text()
  svg = bm.to_svg()
  assert bm.counts["partial"] > 0 and bm.density < 0.01    # statistics from the runs too
  assert len(text.encode()) < 8_000
  assert max(len(line) for line in text.splitlines()[8:]) <= 80
  assert "8,192 × 8,192 tiles" in text and "256 × 256 tiles (32K × 32K tokens) each" in text
  assert "99.6% saved" in text
  assert len(svg.encode()) < 1_000_000
  ET.fromstring(svg)


def test_text_refuses_a_map_being_traced():
  seg = jnp.repeat(jnp.arange(4), 64)

  def draw(s):
    maskc.compile("causal & document(seg)", 256, operands={"seg": s}).to_text()
    return s

  with pytest.raises(maskc.MaskValueError, match="traced"):
    jax.jit(draw)(seg)


def test_a_map_returned_from_jit_renders():
  seg = np.repeat(np.arange(4), 64)
  traced = jax.jit(lambda s: maskc.compile("causal & document(seg)", 256, block_q=32,
                                           block_kv=32, operands={"seg": s}))(jnp.asarray(seg))
  static = maskc.compile("causal & document(seg)", 256, block_q=32, block_kv=32,
                         operands={"seg": seg})
  assert traced.to_text() == static.to_text()


# ----------------------------------------------------------------------------- SVG


def _rects(svg, cls):
  root = ET.fromstring(svg)
  return [r for r in root.iter(f"{SVG}rect") if r.get("class") == cls]


@pytest.mark.parametrize("bm", _maps(), ids=lambda bm: repr(bm.masks))
def test_svg_has_one_rect_per_run(bm):
  svg = bm.to_svg()
  assert svg == bm._repr_html_()
  root = ET.fromstring(svg)
  assert root.tag == f"{SVG}svg"
  panels = render.panels(bm)
  rows = bm.rows
  expected = {"partial": 0, "full": 0}
  for p in panels:  # not downsampled: the cells are the tiles and the runs are the rows' runs
    b = 0 if p.batch is None or rows.count.shape[0] == 1 else p.batch
    for state, name in ((1, "partial"), (2, "full")):
      count = np.asarray(rows.count)[b, p.mask_index]
      valid = np.arange(rows.state.shape[-1]) < count[:, None]
      expected[name] += int(((np.asarray(rows.state)[b, p.mask_index] == state) & valid).sum())
  assert len(_rects(svg, "partial")) == expected["partial"]
  assert len(_rects(svg, "full")) == expected["full"]
  assert len(_rects(svg, "empty")) == len(panels)
  assert render.header_lines(bm)[3] in svg


def test_svg_downsampled_counts_runs_of_cells():
  bm = maskc.compile("sliding(300) | sink(4)", 8192, block_q=16, block_kv=16)  # 512 × 512 tiles
  svg = bm.to_svg()
  pic = render.picture(bm, render.panels(bm)[0], 2, 2)
  _, _, _, state = render.runs_of_cells(pic.cells)
  assert len(_rects(svg, "partial")) == int((state == 1).sum())
  assert len(_rects(svg, "full")) == int((state == 2).sum())
  assert "2 × 2 tiles (32 × 32 tokens) each" in svg


def test_svg_stays_small_for_a_checkerboard():
  bm = maskc.compile("(q // 128 + k // 128) % 3 == 0", 32768, block_q=128, block_kv=128)
  svg = bm.to_svg()
  ET.fromstring(svg)
  assert len(_rects(svg, "partial")) + len(_rects(svg, "full")) <= render.MAX_SVG_RUNS
  assert len(svg.encode()) < 1_500_000


def test_svg_escapes_text():
  bm = maskc.compile("q - k < 2 & k <= q", 64, block_q=16, block_kv=16)
  root = ET.fromstring(bm.to_svg())
  assert root.find(f"{SVG}title").text == "q - k < 2 & k <= q"


# ----------------------------------------------------------------------------- matplotlib


def test_plot_writes_a_png(tmp_path):
  pytest.importorskip("matplotlib")
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib.figure import Figure
  fig = Figure()
  ax = fig.add_subplot()
  bm = maskc.compile("causal & chunk(256) | sink(4)", 1024, block_q=64, block_kv=64)
  assert bm.plot(ax) is ax
  assert [t.get_text() for t in ax.get_xticklabels()][:3] == ["0", "256", "512"]
  assert "full (" in ax.get_legend().get_texts()[0].get_text()
  path = tmp_path / "map.png"
  fig.savefig(path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_makes_one_axes_per_panel():
  pytest.importorskip("matplotlib")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  axes = _maps()[3].plot()
  assert axes.shape == (1, 2)
  plt.close(axes.flat[0].figure)
  ax = _maps()[0].plot()
  assert ax.get_title() == ""
  plt.close(ax.figure)


def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
  real_import = builtins.__import__

  def no_matplotlib(name, *args, **kwargs):
    if name == "matplotlib" or name.startswith("matplotlib."):
      raise ImportError("No module named 'matplotlib'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_matplotlib)
  for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
    monkeypatch.delitem(sys.modules, name)
  with pytest.raises(render.PlotDependencyError, match=r"\.\[plot\]") as info:
    _maps()[0].plot()
  assert isinstance(info.value, maskc.MaskError) and isinstance(info.value, ImportError)


# ----------------------------------------------------------------------------- show


def test_show_small_draws_elements_exactly():
  view = maskc.show("causal", 4, block_q=2, block_kv=2)
  assert view.elements
  assert str(view) == SHOW_CAUSAL_4
  assert repr(view) == SHOW_CAUSAL_4.rstrip("\n")


def test_show_picks_a_few_tiles_for_small_shapes():
  view = maskc.show("causal & chunk(4) | bidirectional(img)", 12,
                    operands={"img": _image(12, [(3, 8)])})
  assert (view.blockmap.block_q, view.blockmap.block_kv) == (4, 4)
  lines = str(view).splitlines()
  assert lines[lines.index("      ┌────┬────┬────┐") + 4] == "    3 │▓▓▓▓│▓▓▓▓│    │"
  np.testing.assert_array_equal(view.dense, maskc.materialize(
      "causal & chunk(4) | bidirectional(img)", 12, operands={"img": _image(12, [(3, 8)])}))


def test_show_svg_draws_elements_over_tiles():
  view = maskc.show("sliding(5) | sink(2)", 20, block_q=8, block_kv=8)
  svg = view._repr_html_()
  root = ET.fromstring(svg)
  classes = [e.get("class") for e in root.iter()]
  assert classes.count("allowed-partial") == 1 and classes.count("tile-grid") == 1
  assert "allowed-full" not in classes  # sliding(5) has no full 8 × 8 tile
  bm = view.blockmap
  assert len(_rects(svg, "partial")) == int(np.asarray(bm.rows.count).sum())


def test_show_large_draws_the_tile_map():
  view = maskc.show("causal & chunk(8192)", 32768)
  assert not view.elements and view.dense is None
  assert (view.blockmap.block_q, view.blockmap.block_kv) == (128, 128)
  assert str(view) == view.blockmap.to_text()
  assert view.to_svg() == view.blockmap.to_svg()


def test_show_panels_for_heads_and_batch():
  img = np.stack([_image(16, [(2, 6)]), _image(16, [(8, 14)])])
  view = maskc.show(["causal | bidirectional(img)", "sliding(3)"], 16, operands={"img": img})
  text = str(view)
  assert text.count("batch ") == 4 + 1  # four panel titles and the header's panels line
  assert view.dense.shape == (2, 2, 16, 16)
  ET.fromstring(view.to_svg())


def test_show_plot_writes_a_png(tmp_path):
  pytest.importorskip("matplotlib")
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib.figure import Figure
  fig = Figure()
  ax = maskc.show("causal & chunk(16)", 48).plot(fig.add_subplot())
  assert ax.get_xlabel() == "k (key position)"
  fig.savefig(tmp_path / "elements.png")
  assert (tmp_path / "elements.png").stat().st_size > 1000


def test_show_reports_bad_input_as_mask_errors():
  with pytest.raises(maskc.MaskError):
    maskc.show("causal &", 8)
  with pytest.raises(maskc.MaskError):
    maskc.show("document(seg)", 8)
  with pytest.raises(maskc.MaskError):
    maskc.show("causal", 8, block_q=0)


# ----------------------------------------------------------------------------- maskc show


def _cli(argv, capsys):
  from maskc import cli
  code = cli.main(argv)
  out, err = capsys.readouterr()
  return code, out, err


def test_cli_show_prints_the_header_and_the_tile_map(capsys):
  code, out, err = _cli(["show", "causal", "--q-len", "512", "--block-q", "128", "--tiles"],
                        capsys)
  assert code == 0 and err == ""
  assert out == CAUSAL_512


def test_cli_show_draws_small_shapes_element_by_element(capsys):
  code, out, _ = _cli(["show", "causal", "--q-len", "4", "--block-q", "2"], capsys)
  assert code == 0
  assert out == SHOW_CAUSAL_4


def test_cli_show_with_range_operands(capsys):
  code, out, _ = _cli(["show", "causal & chunk(8192) | bidirectional(img)", "--q-len", "32768",
                       "--operand", "img=32768:0,1:1000-3000", "--width", "80"], capsys)
  assert code == 0
  lines = out.splitlines()
  assert lines[0] == "causal & chunk(8192) | bidirectional(img)"
  assert "256 × 256 tiles" in out and "8 × 8 tiles (1K × 1K tokens) each" in out
  assert lines[-1].startswith("31K:32K")
  assert lines[9].startswith("   0:1K  ░░░░░░··")  # the image reaches over the causal edge


def test_cli_show_ascii_and_width(capsys):
  code, out, _ = _cli(["show", "causal", "--q-len", "16", "--block-q", "4", "--width", "13",
                       "--tiles", "--ascii"], capsys)
  assert code == 0
  assert out == CAUSAL_8_TILES_4


def test_cli_show_writes_svg_and_png(tmp_path, capsys):
  svg, png = tmp_path / "map.svg", tmp_path / "map.png"
  argv = ["show", "sliding(1024) | sink(4)", "--q-len", "8192", "--svg", str(svg)]
  has_mpl = True
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    has_mpl = False
  if has_mpl:
    argv += ["--png", str(png)]
  code, out, _ = _cli(argv, capsys)
  assert code == 0
  assert f"wrote {svg}" in out
  ET.parse(svg)
  if has_mpl:
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,message", [
    (["show", "causal &", "--q-len", "8"], "line 1, column"),
    (["show", "document(seg)", "--q-len", "8"], "seg"),
    (["show", "causal", "--q-len", "0"], "--q-len must be at least 1"),
    (["show", "causal", "--q-len", "8", "--block-q", "0"], "--block-q must be at least 1"),
    (["show", "causal", "--q-len", "8", "--width", "5"], "--width must be at least 10"),
    (["show", "bidirectional(img)", "--q-len", "8", "--operand", "img=8:0,1:6-9"],
     "reaches past the length 8"),
    (["show", "causal", "--q-len", "8", "--svg", "/nonexistent/dir/x.svg"], "cannot write"),
])
def test_cli_show_errors_exit_1(argv, message, capsys):
  code, _, err = _cli(argv, capsys)
  assert code == 1
  assert message in err and err.startswith("maskc show: error:")


def test_cli_show_usage_errors_exit_2(capsys):
  with pytest.raises(SystemExit) as info:
    _cli(["show", "causal"], capsys)
  assert info.value.code == 2
  assert "--q-len" in capsys.readouterr().err


def test_range_operands():
  from maskc.cli.operands import parse_operand_value, parse_ranges
  np.testing.assert_array_equal(parse_operand_value("8:0,1:2-5,7:7"), [0, 0, 1, 1, 1, 0, 0, 7])
  np.testing.assert_array_equal(parse_ranges("6:-1, 2:0-6, 3:1-3"), [2, 3, 3, 2, 2, 2])
  img = parse_operand_value("32768:0,1:1000-2000")
  assert img.shape == (32768,) and img.sum() == 1000 and img[999] == 0 and img[1000] == 1
  for text, message in (("8:0", "cannot read item 1"), ("8:0,1:5-3", "is empty"),
                        ("8:0,1:2-9", "reaches past the length 8"), ("8:0,x", "item 2"),
                        (f"{1 << 30}:0,1:0-1", "length must be")):
    with pytest.raises(maskc.MaskValueError, match=message):
      parse_operand_value(text)
