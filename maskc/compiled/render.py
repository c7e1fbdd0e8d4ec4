"""Pictures of a `BlockMap`: text art, a self-contained SVG, and a matplotlib plot.

All three draw the same picture. A map has one *panel* per batch row and distinct
head mask (heads that share a mask share a panel). A panel is a grid of *cells*;
when the tile grid is larger than the picture, a cell covers a block of
`rq × ck` tiles (powers of two) and is drawn as the state one tile covering
that block would have:

- FULL if every tile in it is FULL,
- EMPTY if every tile in it is EMPTY,
- PARTIAL otherwise (partial tiles, or a mix of states).

This is the rule a coarser tiling applies, so a downsampled picture is still
sound: a cell drawn FULL or EMPTY is exactly that at every tile.

The cells are computed from the compact runs (`BlockMap.rows`), never from the
tile grid: the cost is `runs + cells`, so a 1M-token map with 128-tiles
(8192 × 8192 tiles) draws in milliseconds and no `n_q × n_kv` array exists.
Positions are tokens; large round numbers are written with K = 1024 and
M = 1024², so `32K` is 32768 tokens.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Sequence
from typing import Any, Literal, TypedDict

import numpy as np

from maskc.compiled.tiles import EMPTY, FULL, PARTIAL
from maskc.language.errors import MaskValueError, MissingExtraError

GLYPHS = {EMPTY: "·", PARTIAL: "░", FULL: "█"}
ASCII_GLYPHS = {EMPTY: ".", PARTIAL: "+", FULL: "#"}
COLORS = {EMPTY: "#eef0f4", PARTIAL: "#f2a541", FULL: "#2f5aa8"}
STATE_NAMES: dict[int, Literal["empty", "partial", "full"]] = {EMPTY: "empty", PARTIAL: "partial",
                                                            FULL: "full"}

MAX_PANELS = 8        # panels drawn; the rest are counted in a note
MAX_SVG_CELLS = 256   # cells per panel axis in the SVG
MAX_SVG_RUNS = 20_000  # <rect> elements in one SVG: keeps a checkerboard map under ~1.5 MB
MAX_PLOT_CELLS = 1024  # cells per panel axis in the matplotlib image


class PlotDependencyError(MissingExtraError):
  """matplotlib, which a picture needs, is not installed (the `plot` extra)."""


# ----------------------------------------------------------------------------- the picture


@dataclasses.dataclass(frozen=True)
class Panel:
  """One batch row and one distinct mask of a map: which heads use it, and its title."""
  batch: int | None
  mask_index: int
  heads: tuple[int, ...] | None
  title: str


@dataclasses.dataclass(frozen=True)
class Picture:
  """A panel downsampled to cells.

  Attributes:
    cells: `int8[rows, cols]`, the state of each cell (see the module docstring).
    rq, ck: tiles per cell along q and k.
    row_edges, col_edges: token offsets of the cell edges (`rows + 1` and `cols + 1`
      of them, the last clipped to `q_len` / `kv_len`); add `q_offset` for q positions.
  """
  cells: np.ndarray
  rq: int
  ck: int
  row_edges: np.ndarray
  col_edges: np.ndarray


def _static(bm, what: str):
  """The row runs of `bm` as NumPy arrays; a clear error for traced maps."""
  import jax
  arrays = []
  for a in bm.rows:
    if isinstance(a, jax.core.Tracer):
      raise MaskValueError(
          f"cannot {what} a BlockMap while it is being traced (inside jax.jit)",
          hint="Draw it outside the jitted function, or compile it with NumPy operands.")
    arrays.append(np.asarray(a))
  return arrays


def panels(bm) -> list[Panel]:
  """Every panel of `bm`: batch rows × distinct masks, in order."""
  n_masks = len(bm.masks)
  out = []
  for b in range(bm.batch or 1):
    for u in range(n_masks):
      heads = None if bm.head_index is None else tuple(
          h for h, x in enumerate(bm.head_index) if x == u)
      if heads == ():
        continue
      parts = []
      if bm.batch is not None:
        parts.append(f"batch {b}")
      if heads is not None:
        parts.append(_heads_text(heads))
      title = " · ".join(parts)
      if heads is not None:
        title += f": {_one_line(str(bm.masks[u]))}"
      out.append(Panel(None if bm.batch is None else b, u, heads, title))
  return out


def _heads_text(heads: Sequence[int]) -> str:
  if len(heads) == 1:
    return f"head {heads[0]}"
  if list(heads) == list(range(heads[0], heads[-1] + 1)):
    return f"heads {heads[0]}–{heads[-1]}"
  return "heads " + ", ".join(map(str, heads))


def _one_line(text: str) -> str:
  return " ; ".join(line.strip() for line in text.splitlines() if line.strip())


class Stats(TypedDict):
  """Tile counts per state, their total, the fraction not EMPTY and of dense FLOPs saved."""
  empty: int
  partial: int
  full: int
  total: int
  density: float
  flops_saved: float


def stats(bm) -> Stats:
  """Tile counts per state and the fraction of dense FLOPs saved, from the runs alone.

  The same numbers as `bm.counts` and `bm.flops_saved`, without building the grid.
  """
  start, stop, state, count = _static(bm, "describe")
  start, stop = start.astype(np.int64), stop.astype(np.int64)
  valid = np.arange(start.shape[-1]) < count[..., None]
  length = np.where(valid, stop - start, 0).astype(np.int64)
  weight = np.ones(start.shape[1], np.int64)  # heads per distinct mask
  if bm.head_index is not None:
    weight = np.bincount(np.asarray(bm.head_index), minlength=start.shape[1])
  n_batch = bm.batch or 1
  shared = n_batch if start.shape[0] == 1 else 1  # runs stored once for every batch row
  w = weight[None, :, None, None] * shared
  partial = int((length * (state == PARTIAL) * w).sum())
  full = int((length * (state == FULL) * w).sum())
  total = bm.n_q_tiles * bm.n_kv_tiles * int(weight.sum()) * n_batch
  rows = np.minimum(bm.block_q, bm.q_len - np.arange(bm.n_q_tiles) * bm.block_q)
  col_tokens = np.where(valid, np.minimum(stop * bm.block_kv, bm.kv_len) - np.minimum(
      start * bm.block_kv, bm.kv_len), 0).astype(np.int64)
  work = int((col_tokens.sum(-1) * rows[None, None, :] * w[..., 0]).sum())
  dense = bm.q_len * bm.kv_len * int(weight.sum()) * n_batch
  return {"empty": total - partial - full, "partial": partial, "full": full, "total": total,
          "density": (partial + full) / total if total else 0.0,
          "flops_saved": 1.0 - work / dense if dense else 0.0}


def power_of_two_scale(n: int, max_cells: int) -> int:
  """The smallest power of two `s` with `ceil(n / s) <= max_cells`."""
  s = 1
  while -(-n // s) > max(1, max_cells):
    s *= 2
  return s


def picture(bm, panel: Panel, rq: int, ck: int) -> Picture:
  """The cells of one panel, `rq × ck` tiles each, computed from the runs."""
  start, stop, state, count = _static(bm, "draw")
  b = 0 if panel.batch is None or start.shape[0] == 1 else panel.batch
  start, stop, state, count = (a[b, panel.mask_index] for a in (start, stop, state, count))
  n_q, n_kv = bm.n_q_tiles, bm.n_kv_tiles
  col_tiles = np.append(np.arange(0, n_kv, ck), n_kv)
  row_tiles = np.append(np.arange(0, n_q, rq), n_q)
  n_cols, n_rows = len(col_tiles) - 1, len(row_tiles) - 1
  valid = np.arange(start.shape[-1]) < count[:, None]
  line = np.broadcast_to(np.arange(n_q)[:, None], valid.shape)[valid]
  a, z, v = start[valid].astype(np.int64), stop[valid].astype(np.int64), state[valid]
  nonempty = _tiles_per_cell(line // rq, a, z, ck, n_rows, n_cols)
  full = _tiles_per_cell(line[v == FULL] // rq, a[v == FULL], z[v == FULL], ck, n_rows, n_cols)
  area = np.diff(row_tiles)[:, None] * np.diff(col_tiles)[None, :]
  cells = np.full((n_rows, n_cols), PARTIAL, np.int8)
  cells[nonempty == 0] = EMPTY
  cells[full == area] = FULL
  return Picture(cells, rq, ck, np.minimum(row_tiles * bm.block_q, bm.q_len),
                 np.minimum(col_tiles * bm.block_kv, bm.kv_len))


def _tiles_per_cell(row, a, z, ck: int, n_rows: int, n_cols: int) -> np.ndarray:
  """How many tiles of the runs `[a, z)` (in cell rows `row`) fall in each cell.

  A run adds its overlap to its first and last cell and `ck` to every cell
  between them (through a difference array): O(runs + cells), not O(grid).
  """
  width = n_cols + 1
  c0, c1 = a // ck, (z - 1) // ck
  one = c0 == c1
  first = np.where(one, z - a, (c0 + 1) * ck - a)
  out = np.bincount(row * width + c0, first, minlength=n_rows * width)
  many = ~one
  out += np.bincount(row[many] * width + c1[many], (z - c1 * ck)[many], minlength=n_rows * width)
  inner = np.bincount(row[many] * width + c0[many] + 1, np.full(many.sum(), ck), minlength=n_rows *
                      width)
  inner -= np.bincount(row[many] * width + c1[many], np.full(many.sum(), ck),
                       minlength=n_rows * width)
  out += np.cumsum(inner.reshape(n_rows, width), axis=1).ravel()
  return out.reshape(n_rows, width)[:, :n_cols].astype(np.int64)


# ----------------------------------------------------------------------------- words


def tokens(n: int) -> str:
  """`n` tokens, short: `32K` for 32768 (K = 1024, M = 1024²) when exact, else `1000`."""
  n = int(n)
  if n and n % (1 << 20) == 0:
    return f"{n >> 20}M"
  if n >= 1024 and n % 1024 == 0:
    return f"{n >> 10}K"
  return str(n)


def _percent(x: float) -> str:
  p = 100 * x
  if p == 0 or p == 100 or 1 <= p <= 99:
    return f"{p:.1f}%"
  return f"{p:.3g}%"


def header_lines(bm, st: Stats | None = None) -> list[str]:
  """The header every picture shares: mask, shape, tiles, batch/heads, density, FLOPs."""
  st = stats(bm) if st is None else st
  lines = []
  if len(bm.masks) == 1:
    lines.append(_one_line(str(bm.masks[0])))
  else:
    lines.append(f"{bm.heads} heads, {len(bm.masks)} distinct masks")
  lines.append(f"shape    {bm.q_len:,} × {bm.kv_len:,} (q × k), q_offset {int(bm.q_offset):,}")
  lines.append(f"tiles    {bm.block_q} × {bm.block_kv} → {bm.n_q_tiles:,} × {bm.n_kv_tiles:,} "
               "tiles" + (" per panel" if bm.batch is not None or bm.heads is not None else ""))
  if bm.batch is not None or bm.heads is not None:
    lines.append(f"panels   {_lead_text(bm)}")
  lines.append(f"density  {_percent(st['density'])} of tiles visited: full {st['full']:,} · "
               f"partial {st['partial']:,} · empty {st['empty']:,}")
  lines.append(f"FLOPs    {_percent(st['flops_saved'])} saved vs dense")
  return lines


def _lead_text(bm) -> str:
  parts = []
  if bm.batch is not None:
    parts.append(f"batch {bm.batch}")
  if bm.heads is not None:
    distinct = "" if len(bm.masks) == bm.heads else f" ({len(bm.masks)} distinct masks)"
    parts.append(f"heads {bm.heads}{distinct}")
  return " × ".join(parts)


def _cell_note(bm, rq: int, ck: int) -> str:
  if rq == 1 and ck == 1:
    return "one per tile"
  return (f"{rq} × {ck} tiles ({tokens(rq * bm.block_q)} × {tokens(ck * bm.block_kv)} tokens) "
          "each; a mixed cell is drawn partial")


# ----------------------------------------------------------------------------- text


def render_text(bm, width: int = 80, *, max_rows: int = 48, max_panels: int = MAX_PANELS,
                ascii: bool = False) -> str:
  """A header and text art of the tile map, each panel downsampled to fit `width` columns.

  Each cell is two characters wide (so a square of tokens looks square): `··`
  empty, `░░` partial, `██` full (`..`, `++`, `##` with `ascii=True`). Rows are
  labelled with the q positions they cover (`start:stop`, half open), and a
  ruler on top gives k positions. When there are more tiles than fit, a cell
  covers `rq × ck` tiles (powers of two, which line up with chunks and
  windows; `rq` chosen so cells are about square in tokens, at most
  `max_rows` rows) and follows the rule in this module's docstring. At most `max_panels`
  panels (batch rows × distinct head masks) are drawn; a last line says how many were left
  out.

  Args:
    bm: a static `BlockMap`.
    width: the widest line of the picture (the header may be longer).
    max_rows: the most rows of cells per panel.
    max_panels: the most panels drawn.
    ascii: draw with ASCII characters only.

  Returns:
    The text, ending with a newline.

  >>> import maskc
  >>> print(maskc.compile("causal", 512).to_text())  # doctest: +ELLIPSIS
  causal
  ...
  """
  glyphs = ASCII_GLYPHS if ascii else GLYPHS
  st = stats(bm)
  lines = header_lines(bm, st)
  ps = panels(bm)
  label_width = max(len(_row_label(bm, 0, bm.q_len)), 4)
  avail = max(2, (width - label_width - 2) // 2)
  ck = power_of_two_scale(bm.n_kv_tiles, avail)  # powers of two line up with chunks, windows
  target = max(1, (ck * bm.block_kv) // bm.block_q)
  rq = min(max(1 << (target.bit_length() - 1), power_of_two_scale(bm.n_q_tiles, max_rows)),
           bm.n_q_tiles)  # a short map (decode) is one row of cells, not a taller block
  lines.append(f"legend   {glyphs[FULL]} full  {glyphs[PARTIAL]} partial  {glyphs[EMPTY]} empty")
  lines.append(f"cells    {_cell_note(bm, rq, ck)}")
  for panel in ps[:max_panels]:
    lines.append("")
    if panel.title:
      lines.append(panel.title)
    lines.extend(_text_panel(bm, picture(bm, panel, rq, ck), glyphs))
  if len(ps) > max_panels:
    lines.append("")
    lines.append(f"… {len(ps) - max_panels} more panels not shown (max_panels={max_panels})")
  return "\n".join(lines) + "\n"


def _row_label(bm, a: int, z: int) -> str:
  off = int(bm.q_offset)
  return f"{tokens(off + a)}:{tokens(off + z)}"


def _text_panel(bm, pic: Picture, glyphs: dict[int, str]) -> list[str]:
  labels = [_row_label(bm, a, z) for a, z in zip(pic.row_edges[:-1], pic.row_edges[1:])]
  lw = max(4, *(len(s) for s in labels))
  n_cols = pic.cells.shape[1]
  ticks = [tokens(t) for t in pic.col_edges[:-1]]
  every = 1  # label every `every`-th cell edge, evenly, where the labels fit
  while any(len(ticks[c]) + 1 > 2 * every for c in range(0, n_cols, every)):
    every *= 2
  ruler = [" "] * (2 * n_cols)
  for c in range(0, n_cols, every):
    text = ticks[c]
    if 2 * c + len(text) <= len(ruler):
      ruler[2 * c:2 * c + len(text)] = text
  corner = "q \\ k"
  out = [f"{corner:>{lw}}  {''.join(ruler).rstrip()}"]
  for label, row in zip(labels, pic.cells):
    out.append(f"{label:>{lw}}  " + "".join(2 * glyphs[int(v)] for v in row))
  return out


# ----------------------------------------------------------------------------- SVG


def nice_ticks(lo: int, hi: int, n: int = 6) -> list[int]:
  """Tick positions in `[lo, hi]`: multiples of a power of two, at most about `n` of them."""
  span = max(1, hi - lo)
  step = 1
  while span / step > n:
    step *= 2
  first = -(-lo // step) * step
  return list(range(first, hi + 1, step))


def _attrs(attrs: dict[str, Any]) -> str:
  """Extra XML attributes: `class_` → `class`, `stroke_width` → `stroke-width`, values escaped."""
  return "".join(f' {k.rstrip("_").replace("_", "-")}="{html.escape(str(v))}"'
                 for k, v in attrs.items())


class Svg:
  """A tiny SVG writer: numbers rounded, text escaped, one element per call."""

  def __init__(self) -> None:
    self.parts: list[str] = []

  def rect(self, x: float, y: float, w: float, h: float, fill: str, **attrs: Any) -> None:
    extra = _attrs(attrs)
    self.parts.append(f'<rect x="{x:.6g}" y="{y:.6g}" width="{w:.6g}" height="{h:.6g}" '
                      f'fill="{fill}"{extra}/>')

  def text(self, x: float, y: float, s: str, size: float = 11, anchor: str = "start",
           weight: str = "normal", fill: str = "#222", **attrs: Any) -> None:
    extra = _attrs(attrs)
    self.parts.append(f'<text x="{x:.6g}" y="{y:.6g}" font-size="{size}" text-anchor="{anchor}" '
                      f'font-weight="{weight}" fill="{fill}"{extra}>{html.escape(s)}</text>')

  def path(self, d: str, stroke: str, width: float = 1.0, **attrs: Any) -> None:
    extra = _attrs(attrs)
    self.parts.append(f'<path d="{d}" stroke="{stroke}" stroke-width="{width:.3g}" fill="none"'
                      f'{extra}/>')

  def raw(self, s: str) -> None:
    self.parts.append(s)

  def document(self, width: float, height: float, title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans, Helvetica, Arial, '
            f'sans-serif"><title>{html.escape(title)}</title>'
            f'<rect x="0" y="0" width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>'
            + "".join(self.parts) + "</svg>")


def _panel_size(q_len: int, kv_len: int, side: float = 360.0) -> tuple[float, float]:
  """Pixel width and height of a panel, proportional to tokens within sane bounds."""
  aspect = q_len / kv_len
  if aspect <= 1:
    return side, max(side * aspect, 36.0)
  return max(side / aspect, 36.0), side


def runs_of_cells(cells: np.ndarray):
  """`(row, start, stop, state)` of each maximal run of equal non-empty cells in a row."""
  pad = np.zeros((cells.shape[0], 1), cells.dtype)
  prev = np.concatenate([pad - 1, cells[:, :-1]], axis=1)
  nxt = np.concatenate([cells[:, 1:], pad - 1], axis=1)
  r0, c0 = np.nonzero((cells != prev) & (cells != EMPTY))
  _, c1 = np.nonzero((cells != nxt) & (cells != EMPTY))
  return r0, c0, c1 + 1, cells[r0, c0]


def svg_axes(s: Svg, x0: float, y0: float, pw: float, ph: float, q_lo: int, q_len: int,
             kv_len: int) -> None:
  """Tick marks and labels in tokens around a panel at `(x0, y0)` of size `pw × ph`."""
  ticks = []
  for t in nice_ticks(0, kv_len, max(1, int(pw // 56))):
    x = x0 + pw * t / kv_len
    ticks.append(f"M{x:.6g} {y0:.6g}v-4")
    s.text(x, y0 - 7, tokens(t), size=10, anchor="middle", fill="#444")
  for t in nice_ticks(q_lo, q_lo + q_len, max(1, int(ph // 56))):
    y = y0 + ph * (t - q_lo) / q_len
    ticks.append(f"M{x0:.6g} {y:.6g}h-4")
    s.text(x0 - 7, y + 3.5, tokens(t), size=10, anchor="end", fill="#444")
  s.path("".join(ticks), "#666")
  s.rect(x0, y0, pw, ph, "none", stroke="#888", stroke_width="0.8")


def svg_axis_titles(s: Svg, x0: float, y0: float, pw: float, ph: float) -> None:
  """`k (key position)` under a panel and `q (query position)` (or `q` when short) beside it."""
  s.text(x0 + pw / 2, y0 + ph + 16, "k (key position)", size=10, anchor="middle", fill="#666")
  s.text(x0 - 48, y0 + ph / 2, "q (query position)" if ph >= 130 else "q", size=10,
         anchor="middle", fill="#666", transform=f"rotate(-90 {x0 - 48:.6g} {y0 + ph / 2:.6g})")


def svg_legend(s: Svg, x: float, y: float, items: Sequence[tuple[str, str]]) -> float:
  """Colour swatches with labels in a row from `(x, y)`; returns the x where the row ends."""
  for fill, label in items:
    s.rect(x, y - 9, 11, 11, fill, stroke="#777", stroke_width="0.5", class_="legend")
    s.text(x + 15, y, label, size=11, fill="#333")
    x += 22 + 6.2 * len(label)
  return x


def svg_panel_grid(s: Svg, panels, draw, *, top: float, pw: float, ph: float, cols: int,
                   rows: int, margin_l: float, gap_x: float, gap_y: float, q_offset: int,
                   q_len: int, kv_len: int, hidden: int, max_panels: int, min_width: float,
                   lines: Sequence[str]) -> str:
  """Lays out `(title, item)` panels in a grid, `draw(item, x0, y0)` filling each, with
  axes in tokens, a note on panels left out, and returns the finished SVG document."""
  for n, (title, item) in enumerate(panels):
    x0 = margin_l + (n % cols) * (pw + gap_x)
    y0 = top + (n // cols) * (ph + gap_y)
    if title:
      s.text(x0, y0 - 24, _clip(title, int((pw + gap_x) // 6.5)), size=11, weight="bold",
             fill="#222")
    draw(item, x0, y0)
    svg_axes(s, x0, y0, pw, ph, q_offset, q_len, kv_len)
    svg_axis_titles(s, x0, y0, pw, ph)
  height = top + rows * (ph + gap_y) - 10
  if hidden > 0:
    s.text(12, height, f"… {hidden} more panels not shown (max_panels={max_panels})", size=11,
           fill="#a33")
    height += 14
  width = max(margin_l + cols * (pw + gap_x), min_width, 12 + 6.4 * max(len(x) for x in lines))
  return s.document(width, height, lines[0])


def render_svg(bm, *, max_panels: int = MAX_PANELS, max_cells: int = MAX_SVG_CELLS,
               max_runs: int = MAX_SVG_RUNS, panel_side: float = 360.0) -> str:
  """The tile map as a self-contained SVG document (no dependency, no script, no style sheet).

  A title and header (mask, shape, tiles, density, FLOPs saved), a legend, then
  one panel per batch row and distinct head mask (at most `max_panels`). Each
  panel is an EMPTY-colored background with one `<rect>` per run of equal
  non-empty cells along a row (`class="partial"` or `class="full"`), axis ticks
  in tokens, and tile boundaries when tiles are large enough to see. Panels are
  downsampled to at most `max_cells` cells per axis, and further while they
  would need more than `max_runs` rects in all, so the SVG stays small (about a
  megabyte at worst) whatever the map's size.

  Args:
    bm: a static `BlockMap`.
    max_panels: the most panels drawn.
    max_cells: the most cells per panel axis.
    max_runs: the most `<rect>`s for tile runs in the whole document.
    panel_side: the longer side of a panel in pixels.

  Returns:
    The SVG text, well-formed XML.
  """
  st = stats(bm)
  ps = panels(bm)
  shown = ps[:max_panels]
  ck = power_of_two_scale(bm.n_kv_tiles, max_cells)
  rq = power_of_two_scale(bm.n_q_tiles, max_cells)
  pics = [picture(bm, p, rq, ck) for p in shown]
  while sum(len(runs_of_cells(p.cells)[0]) for p in pics) > max_runs and \
      max(pics[0].cells.shape) > 1:  # coarser until the rects fit the budget
    rq *= 2 if pics[0].cells.shape[0] > 1 else 1
    ck *= 2 if pics[0].cells.shape[1] > 1 else 1
    pics = [picture(bm, p, rq, ck) for p in shown]
  pw, ph = _panel_size(bm.q_len, bm.kv_len, panel_side)
  n_grid_cols = min(len(shown), max(1, int(1200 // (pw + 90))))
  n_grid_rows = -(-len(shown) // n_grid_cols)
  margin_l, gap_x, gap_y = 64.0, 84.0, 58.0
  head = header_lines(bm, st)
  top = 26 + 16 * (len(head) - 1) + 30
  s = Svg()
  s.text(12, 22, head[0], size=14, weight="bold", fill="#111")
  for i, line in enumerate(head[1:]):
    s.text(12, 40 + 16 * i, line, size=11, fill="#444")
  legend_y = 40 + 16 * (len(head) - 1) + 2
  legend_end = svg_legend(s, 12, legend_y, [(COLORS[FULL], f"full ({st['full']:,})"),
                               (COLORS[PARTIAL], f"partial ({st['partial']:,})"),
                               (COLORS[EMPTY], f"empty ({st['empty']:,})")])
  note = f"cells: {_cell_note(bm, rq, ck)}"
  s.text(12, legend_y + 17, note, size=10, fill="#666")
  top = legend_y + 17 + 44
  return svg_panel_grid(
      s, [(panel.title, pic) for panel, pic in zip(shown, pics)],
      lambda pic, x0, y0: _svg_cells(s, bm, pic, x0, y0, pw, ph),
      top=top, pw=pw, ph=ph, cols=n_grid_cols, rows=n_grid_rows, margin_l=margin_l, gap_x=gap_x,
      gap_y=gap_y, q_offset=int(bm.q_offset), q_len=bm.q_len, kv_len=bm.kv_len,
      hidden=len(ps) - len(shown), max_panels=max_panels, min_width=legend_end,
      lines=head + [note])


def _clip(text: str, n: int) -> str:
  return text if len(text) <= n else text[:max(1, n - 1)] + "…"


def _svg_cells(s: Svg, bm, pic: Picture, x0: float, y0: float, pw: float, ph: float) -> None:
  """The background, one rect per run of non-empty cells, and tile lines when visible."""
  xs = x0 + pw * pic.col_edges / bm.kv_len
  ys = y0 + ph * pic.row_edges / bm.q_len
  s.raw('<g shape-rendering="crispEdges">')
  s.rect(x0, y0, pw, ph, COLORS[EMPTY], class_="empty")
  for r, a, z, v in zip(*runs_of_cells(pic.cells)):
    s.rect(xs[a], ys[r], xs[z] - xs[a], ys[r + 1] - ys[r], COLORS[int(v)],
           class_=STATE_NAMES[int(v)])
  n_rows, n_cols = pic.cells.shape
  if pic.rq == 1 and pic.ck == 1 and min(pw / n_cols, ph / n_rows) >= 6 and max(n_rows,
                                                                                 n_cols) > 1:
    d = "".join(f"M{x:.6g} {y0:.6g}V{y0 + ph:.6g}" for x in xs[1:-1])
    d += "".join(f"M{x0:.6g} {y:.6g}H{x0 + pw:.6g}" for y in ys[1:-1])
    if d:
      s.path(d, "#ffffff", 1.0, stroke_opacity="0.9")
  s.raw("</g>")


# ----------------------------------------------------------------------------- matplotlib


def matplotlib_modules() -> tuple[Any, Any]:
  """matplotlib's `colors` and `patches` modules."""
  try:
    import matplotlib  # noqa: F401
    from matplotlib import colors, patches
  except ImportError:
    raise PlotDependencyError(
        "plotting needs matplotlib, which is not installed", extra="plot",
        hint="Or use `to_svg()` / `to_text()`, which need nothing.") from None
  return colors, patches


def plot(bm, ax=None, *, panel: int | None = None, max_cells: int = MAX_PLOT_CELLS,
         legend: bool = True):
  """Draws the tile map with matplotlib: one image per panel, ticks in tokens, a legend.

  Args:
    bm: a static `BlockMap`.
    ax: the axes to draw on. When given, one panel is drawn (`panel`, default 0).
      When None, a new figure holds every panel (at most `MAX_PANELS`).
    panel: which panel to draw on `ax` (batch rows × distinct head masks, in order).
    max_cells: the most cells per axis (see the module docstring for downsampling).
    legend: add a legend of the three states with their counts.

  Returns:
    The axes drawn on: `ax`, the new axes for one panel, or an array of axes.

  Raises:
    PlotDependencyError: matplotlib is not installed (the `plot` extra).
  """
  colors, _ = matplotlib_modules()
  ps = panels(bm)
  if ax is None:
    import matplotlib.pyplot as plt
    shown = ps[:MAX_PANELS] if panel is None else [ps[panel_index(panel, ps)]]
    ncols = min(len(shown), 4)
    nrows = -(-len(shown) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.8 * nrows), squeeze=False,
                             layout="constrained")
    for a, p in zip(axes.flat, shown):
      _plot_panel(bm, a, p, max_cells, colors, legend=legend and a is axes.flat[0])
    for a in list(axes.flat)[len(shown):]:
      a.set_visible(False)
    fig.suptitle(_one_line(header_lines(bm)[0]), fontsize=11)
    return axes[0, 0] if len(shown) == 1 else axes
  p = ps[panel_index(panel or 0, ps)]
  _plot_panel(bm, ax, p, max_cells, colors, legend=legend, title=True)
  return ax


def panel_index(panel: int, ps: list[Panel]) -> int:
  """`panel` (negative counts from the end) as an index into the panels `ps`, checked."""
  if not -len(ps) <= panel < len(ps):
    raise MaskValueError(f"panel={panel} is out of range: this map has {len(ps)} panels")
  return panel % len(ps)


def _plot_panel(bm, ax, panel: Panel, max_cells: int, colors, legend: bool,
                title: bool = False) -> None:
  from matplotlib import patches
  ck = power_of_two_scale(bm.n_kv_tiles, max_cells)
  rq = power_of_two_scale(bm.n_q_tiles, max_cells)
  pic = picture(bm, panel, rq, ck)
  off = int(bm.q_offset)
  n_rows, n_cols = pic.cells.shape
  # uniform cells: the last may reach past the end; the axis limits clip it back
  extent = (0, n_cols * ck * bm.block_kv, off + n_rows * rq * bm.block_q, off)
  cmap = colors.ListedColormap([COLORS[EMPTY], COLORS[PARTIAL], COLORS[FULL]])
  norm = colors.BoundaryNorm([-0.5, 0.5, 1.5, 2.5], 3)
  aspect = bm.q_len / bm.kv_len
  ax.imshow(pic.cells, cmap=cmap, norm=norm, extent=extent, interpolation="nearest",
            aspect="equal" if 1 / 8 <= aspect <= 8 else "auto")
  ax.set_xlim(0, bm.kv_len)
  ax.set_ylim(off + bm.q_len, off)
  xt = nice_ticks(0, bm.kv_len)
  yt = nice_ticks(off, off + bm.q_len)
  ax.set_xticks(xt, [tokens(t) for t in xt])
  ax.set_yticks(yt, [tokens(t) for t in yt])
  ax.xaxis.tick_top()
  ax.xaxis.set_label_position("top")
  ax.set_xlabel("k (key position)")
  ax.set_ylabel("q (query position)")
  if pic.rq == 1 and pic.ck == 1 and max(n_rows, n_cols) <= 64 and max(n_rows, n_cols) > 1:
    for x in pic.col_edges[1:-1]:
      ax.axvline(x, color="white", linewidth=0.8)
    for y in pic.row_edges[1:-1]:
      ax.axhline(off + y, color="white", linewidth=0.8)
  ttl = panel.title or ""
  if title:
    ttl = _one_line(header_lines(bm)[0]) + (f"\n{ttl}" if ttl else "")
  if ttl:
    ax.set_title(ttl, fontsize=10)
  if legend:
    st = stats(bm)
    handles = [patches.Patch(facecolor=COLORS[v], edgecolor="#777", linewidth=0.5,
                             label=f"{STATE_NAMES[v]} ({st[STATE_NAMES[v]]:,})")
               for v in (FULL, PARTIAL, EMPTY)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=3,
              fontsize=8, frameon=False, handlelength=1.2, columnspacing=1.2,
              title=f"{bm.block_q}×{bm.block_kv} tiles, density {_percent(st['density'])}, "
                    f"{_percent(st['flops_saved'])} of FLOPs saved", title_fontsize=8)
