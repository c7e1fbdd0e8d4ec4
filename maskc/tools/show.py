"""`maskc.show`: look at a mask at a shape, elements and tiles together.

Small shapes (at most `MAX_ELEMENT_ROWS × MAX_ELEMENT_COLS`) are drawn element
by element with the tile grid over them, so the reader sees which positions
are allowed *and* what the kernel does with each tile. Larger shapes are drawn
as the compiled tile map (`maskc.compiled.render`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from jax.typing import ArrayLike

from maskc.compiled import render
from maskc.compiled.blockmap import EMPTY, FULL, PARTIAL, BlockMap
from maskc.language.arguments import MasksLike
from maskc.language.errors import MaskTypeError
from maskc.lowering.compile import compile as compile_
from maskc.semantics.dense import materialize

MAX_ELEMENT_ROWS = 256
MAX_ELEMENT_COLS = 512

# element glyphs by (tile state, allowed): a FULL tile is all allowed, an EMPTY tile all masked
ELEMENT_GLYPHS = {(FULL, True): "█", (PARTIAL, True): "▓", (PARTIAL, False): "·",
                  (EMPTY, False): " "}
ELEMENT_ASCII = {(FULL, True): "#", (PARTIAL, True): "+", (PARTIAL, False): ".",
                 (EMPTY, False): " "}
TILE_TINTS = {EMPTY: "#f1f2f5", PARTIAL: "#fbe3bd", FULL: "#2f5aa8"}
ALLOWED = {FULL: "#2f5aa8", PARTIAL: "#6d8fd0"}  # allowed elements, by the state of their tile
LEGEND = ((ALLOWED[FULL], "allowed, full tile"), (ALLOWED[PARTIAL], "allowed, partial tile"),
          (TILE_TINTS[PARTIAL], "masked, partial tile"), (TILE_TINTS[EMPTY], "empty tile"))


def show(mask: MasksLike, q_len: int, kv_len: int | None = None, *,
         q_offset: int | None = None, operands: Mapping[str, ArrayLike] | None = None,
         block_q: int | None = None, block_kv: int | None = None) -> MaskView:
  """Draws a mask at a shape: every element with the tile grid over it, or the tile map.

  For shapes up to 256 × 512 the picture shows each `(q, k)` element and the
  tiles it falls in; for larger ones, the compiled tile map (downsampled).
  In a notebook the result displays as SVG; `print` gives text art, and
  `.plot()` draws with matplotlib.

  Args:
    mask: a Mask, mask text, or a sequence of them (one per head).
    q_len: query rows. kv_len: key columns (default `q_len`).
    q_offset: position of row 0 (default `kv_len - q_len`).
    operands: runtime operand values by name (NumPy; static).
    block_q, block_kv: tile sizes. By default 128 for large shapes, and for small
      ones a power of two giving a few tiles per axis, so the grid is visible.

  Returns:
    A `MaskView`, with `.blockmap`, `.dense` (element-level views only), `.to_text()`,
    `.to_svg()` and `.plot()`.

  Raises:
    MaskError: the mask, shape or operands are invalid (as in `maskc.compile`).

  >>> import maskc
  >>> print(maskc.show("causal", 4, block_q=2, block_kv=2))  # doctest: +ELLIPSIS
  causal
  ...
  """
  kv = q_len if kv_len is None else kv_len
  small = _is_int(q_len) and _is_int(kv) and q_len <= MAX_ELEMENT_ROWS and \
      kv <= MAX_ELEMENT_COLS
  if block_q is None or block_kv is None:
    default = _small_block(max(q_len, kv)) if small else 128
    block_q = default if block_q is None else block_q
    block_kv = block_q if block_kv is None else block_kv
  bm = compile_(mask, q_len, kv_len, block_q=block_q, block_kv=block_kv, q_offset=q_offset,
                operands=operands)
  dense = None
  if small:
    dense = np.asarray(materialize(mask, q_len, kv_len, q_offset=q_offset, operands=operands))
  return MaskView(bm, dense)


def _is_int(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _small_block(n: int) -> int:
  """A power of two giving three to about six tiles along `n` (at most 128)."""
  b = 1
  while b * 2 <= max(1, n // 3) and b < 128:
    b *= 2
  return b


class MaskView:
  """A mask at a shape, ready to look at: `print` it, display it in a notebook, or plot it.

  Attributes:
    blockmap: the compiled `BlockMap`.
    dense: the mask's elements, bool `[..., q_len, kv_len]`, for element-level
      views; None when the shape is too large to draw element by element.
  """

  def __init__(self, blockmap: BlockMap, dense: np.ndarray | None = None) -> None:
    if not isinstance(blockmap, BlockMap):
      raise MaskTypeError(f"MaskView needs a BlockMap, got {type(blockmap).__name__}")
    self.blockmap = blockmap
    self.dense = dense

  @property
  def elements(self) -> bool:
    """Whether this view draws elements (small shapes) rather than the tile map."""
    return self.dense is not None

  def to_text(self, width: int = 80, *, ascii: bool = False) -> str:
    """Text art: elements with tile boundaries, or the tile map downsampled to `width`."""
    if self.dense is not None:  # `elements`
      return element_text(self.blockmap, self.dense, ascii=ascii)
    return render.render_text(self.blockmap, width=width, ascii=ascii)

  def to_svg(self) -> str:
    """A self-contained SVG picture."""
    if self.dense is not None:
      return element_svg(self.blockmap, self.dense)
    return render.render_svg(self.blockmap)

  def plot(self, ax: Any = None) -> Any:
    """Draws with matplotlib (the `plot` extra) and returns the axes."""
    if self.dense is not None:
      return element_plot(self.blockmap, self.dense, ax=ax)
    return render.plot(self.blockmap, ax=ax)

  def _repr_html_(self) -> str:
    return self.to_svg()

  def __str__(self) -> str:
    return self.to_text()

  def __repr__(self) -> str:
    return self.to_text().rstrip("\n")


# ----------------------------------------------------------------------------- element views


def _planes(bm: BlockMap, dense: np.ndarray) -> list[tuple[render.Panel, np.ndarray, np.ndarray]]:
  """`(panel, elements [q, k], tiles [nq, nk])` per panel (batch row × distinct mask)."""
  grid = np.asarray(bm.grid)
  out = []
  for p in render.panels(bm):
    idx: tuple[int, ...] = ()
    if p.batch is not None:  # the map has a batch
      idx += (p.batch,)
    if p.heads is not None:
      idx += (p.heads[0],)
    el = dense[idx] if dense.ndim > 2 else dense
    out.append((p, np.asarray(el, bool), grid[idx]))
  return out


def _element_header(bm: BlockMap, ascii: bool) -> list[str]:
  g = ELEMENT_ASCII if ascii else ELEMENT_GLYPHS
  lines = render.header_lines(bm)
  lines.append(f"legend   {g[FULL, True]} allowed, full tile   {g[PARTIAL, True]} allowed, partial "
               f"tile   {g[PARTIAL, False]} masked, partial tile   blank: empty tile")
  return lines


def element_text(bm: BlockMap, dense: np.ndarray, *, ascii: bool = False,
                 max_panels: int = render.MAX_PANELS) -> str:
  """Text art of every element, one character each, with tile boundaries drawn between."""
  glyphs = ELEMENT_ASCII if ascii else ELEMENT_GLYPHS
  box = dict(zip(("v", "h", "tl", "tm", "tr", "ml", "mm", "mr", "bl", "bm", "br"),
                 "|-+++++++++" if ascii else "│─┌┬┐├┼┤└┴┘"))
  lines = _element_header(bm, ascii)
  planes = _planes(bm, dense)
  for p, el, tiles in planes[:max_panels]:
    lines.append("")
    if p.title:
      lines.append(p.title)
    lines.extend(_element_panel(bm, el, tiles, glyphs, box))
  if len(planes) > max_panels:
    lines.append("")
    lines.append(f"… {len(planes) - max_panels} more panels not shown (max_panels={max_panels})")
  return "\n".join(lines) + "\n"


def _element_panel(bm: BlockMap, el: np.ndarray, tiles: np.ndarray,
                   glyphs: Mapping[tuple[int, bool], str], box: Mapping[str, str]) -> list[str]:
  q_len, kv_len = el.shape
  bq, bk = bm.block_q, bm.block_kv
  off = int(bm.q_offset)
  col_starts = list(range(0, kv_len, bk))
  widths = [min(bk, kv_len - c) for c in col_starts]
  lw = max(len("q \\ k"), len(str(off + q_len - 1)))
  # k ruler: each tile's first position, where it fits in the tile's width
  ruler = "".join(f"{c:<{w}}"[:w] if len(str(c)) <= w else " " * w for c, w in
                  zip(col_starts, widths))
  ruler = " ".join(ruler[sum(widths[:t]):sum(widths[:t + 1])] for t in range(len(widths)))

  def border(left: str, mid: str, right: str) -> str:
    return f"{'':>{lw}} {left}" + mid.join(box["h"] * w for w in widths) + right

  corner = "q \\ k"
  out = [f"{corner:>{lw}}  {ruler.rstrip()}", border(box["tl"], box["tm"], box["tr"])]
  for i in range(q_len):
    if i and i % bq == 0:
      out.append(border(box["ml"], box["mm"], box["mr"]))
    ti = i // bq
    cells = []
    for t, (c, w) in enumerate(zip(col_starts, widths)):
      state = int(tiles[ti, t])
      cells.append("".join(glyphs.get((state, bool(v)), "?") for v in el[i, c:c + w]))
    out.append(f"{off + i:>{lw}} {box['v']}" + box["v"].join(cells) + box["v"])
  out.append(border(box["bl"], box["bm"], box["br"]))
  return out


def element_svg(bm: BlockMap, dense: np.ndarray, *, max_panels: int = render.MAX_PANELS) -> str:
  """An SVG of every element over tinted tiles, with the tile grid and axes in tokens.

  Per panel: one `<rect>` per run of tiles of one state (tinted), one `<path>`
  holding every run of allowed elements, one `<path>` for the tile grid.
  """
  planes = _planes(bm, dense)
  shown = planes[:max_panels]
  q_len, kv_len = bm.q_len, bm.kv_len
  cell = max(1.0, min(24.0, 560.0 / kv_len, 420.0 / q_len))
  pw, ph = cell * kv_len, cell * q_len
  n_grid_cols = min(len(shown), max(1, int(1200 // (pw + 90))))
  n_grid_rows = -(-len(shown) // n_grid_cols)
  margin_l, gap_x, gap_y = 64.0, 84.0, 58.0
  head = render.header_lines(bm)
  s = render.Svg()
  s.text(12, 22, head[0], size=14, weight="bold", fill="#111")
  for i, line in enumerate(head[1:]):
    s.text(12, 40 + 16 * i, line, size=11, fill="#444")
  legend_y = 40 + 16 * (len(head) - 1) + 2
  legend_end = render.svg_legend(s, 12, legend_y, LEGEND)
  top = legend_y + 50
  return render.svg_panel_grid(
      s, [(p.title, (el, tiles)) for p, el, tiles in shown],
      lambda item, x0, y0: _element_cells(s, bm, item[0], item[1], x0, y0, cell),
      top=top, pw=pw, ph=ph, cols=n_grid_cols, rows=n_grid_rows, margin_l=margin_l, gap_x=gap_x,
      gap_y=gap_y, q_offset=int(bm.q_offset), q_len=q_len, kv_len=kv_len,
      hidden=len(planes) - len(shown), max_panels=max_panels, min_width=legend_end, lines=head)


def _element_cells(s: render.Svg, bm: BlockMap, el: np.ndarray, tiles: np.ndarray, x0: float,
                   y0: float, cell: float) -> None:
  q_len, kv_len = el.shape
  xs = x0 + cell * np.minimum(np.arange(tiles.shape[1] + 1) * bm.block_kv, kv_len)
  ys = y0 + cell * np.minimum(np.arange(tiles.shape[0] + 1) * bm.block_q, q_len)
  s.raw('<g shape-rendering="crispEdges">')
  s.rect(x0, y0, cell * kv_len, cell * q_len, TILE_TINTS[EMPTY], class_="empty")
  for r, a, z, v in zip(*render.runs_of_cells(tiles)):
    s.rect(xs[a], ys[r], xs[z] - xs[a], ys[r + 1] - ys[r], TILE_TINTS[int(v)],
           class_=render.STATE_NAMES[int(v)])
  in_full = _tile_of(bm, el, tiles) == FULL
  for state, name in ((FULL, "allowed-full"), (PARTIAL, "allowed-partial")):
    r, a, z, _ = render.runs_of_cells((el & (in_full == (state == FULL))).astype(np.int8))
    d = "".join(f"M{x0 + cell * c:.6g} {y0 + cell * i:.6g}h{cell * (e - c):.6g}v{cell:.6g}"
                f"h{-cell * (e - c):.6g}z" for i, c, e in zip(r, a, z))
    if d:
      s.raw(f'<path d="{d}" fill="{ALLOWED[state]}" class="{name}"/>')
  grid = "".join(f"M{x:.6g} {y0:.6g}V{y0 + cell * q_len:.6g}" for x in xs[1:-1])
  grid += "".join(f"M{x0:.6g} {y:.6g}H{x0 + cell * kv_len:.6g}" for y in ys[1:-1])
  if grid:
    s.path(grid, "#30343b", 1.0, stroke_opacity="0.55", class_="tile-grid")
  s.raw("</g>")


def _tile_of(bm: BlockMap, el: np.ndarray, tiles: np.ndarray) -> np.ndarray:
  """The state of the tile each element lies in, `[q_len, kv_len]`."""
  return tiles[np.arange(el.shape[0])[:, None] // bm.block_q,
               np.arange(el.shape[1])[None, :] // bm.block_kv]


def element_plot(bm: BlockMap, dense: np.ndarray, ax: Any = None, *, panel: int = 0) -> Any:
  """Draws one panel's elements over tinted tiles with matplotlib; returns the axes."""
  from matplotlib import colors as mcolors
  _, patches = render.matplotlib_modules()
  planes = _planes(bm, dense)
  p, el, tiles = planes[render.panel_index(panel, [x[0] for x in planes])]
  if ax is None:
    import matplotlib.pyplot as plt
    _, ax = plt.subplots(figsize=(6, 5.4), layout="constrained")
  rgb = {k: np.array(mcolors.to_rgb(c)) for k, c in TILE_TINTS.items()}
  tile_of = _tile_of(bm, el, tiles)
  img = np.select([tile_of[..., None] == s for s in (EMPTY, PARTIAL, FULL)],
                  [rgb[EMPTY], rgb[PARTIAL], rgb[FULL]])
  img[el & (tile_of == FULL)] = mcolors.to_rgb(ALLOWED[FULL])
  img[el & (tile_of != FULL)] = mcolors.to_rgb(ALLOWED[PARTIAL])
  off = int(bm.q_offset)
  ax.imshow(img, extent=(0, el.shape[1], off + el.shape[0], off), interpolation="nearest",
            aspect="equal" if 1 / 8 <= el.shape[0] / el.shape[1] <= 8 else "auto")
  for x in range(bm.block_kv, el.shape[1], bm.block_kv):
    ax.axvline(x, color="#30343b", linewidth=0.8, alpha=0.6)
  for y in range(bm.block_q, el.shape[0], bm.block_q):
    ax.axhline(off + y, color="#30343b", linewidth=0.8, alpha=0.6)
  xt = render.nice_ticks(0, el.shape[1])
  yt = render.nice_ticks(off, off + el.shape[0])
  ax.set_xticks(xt, [render.tokens(t) for t in xt])
  ax.set_yticks(yt, [render.tokens(t) for t in yt])
  ax.xaxis.tick_top()
  ax.xaxis.set_label_position("top")
  ax.set_xlabel("k (key position)")
  ax.set_ylabel("q (query position)")
  title = render.header_lines(bm)[0] + (f"\n{p.title}" if p.title else "")
  ax.set_title(title, fontsize=10)
  handles = [patches.Patch(facecolor=c, edgecolor="#777", linewidth=0.5, label=name)
             for c, name in LEGEND]
  ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2,
            fontsize=8, frameon=False, handlelength=1.2, columnspacing=1.2,
            title=f"{bm.block_q}×{bm.block_kv} tiles", title_fontsize=8)
  return ax
