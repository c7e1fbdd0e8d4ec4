"""The lowering's tuning constants, in one table: chunk sizes, cut counts, thresholds and the
bytes charged to the memory budget per item of work.

None of them changes a tile: each bounds how much work or memory one step takes, or picks
between two ways to the same tiles. A module of the lowering imports the ones it uses from
here (`from maskc.lowering.tuning import LEAF_CHUNK`); a test that needs a small chunk patches
the name in the module that reads it. This module imports nothing, so every stage of the
lowering (grid, closed forms, static and traced paths) may import it. Measurements behind the
thresholds are in `docs/lowering.md`.
"""

from __future__ import annotations

# --- The memory budget and the refinement of tiles (`maskc.lowering.grid.refine`).

MEMORY_BUDGET = 256 << 20  # default bytes a lowering may allocate beyond its operands
EVAL_CHUNK = 1 << 18  # elements evaluated at once when refining tiles: bounds the dense chunk
PIECE_CHUNK = 1 << 16  # rectangles analysed at once when refining tiles: bounds work arrays
ITEM_BYTES = 256  # working memory per rectangle analysed at once (intervals, flags, indices)
NODE_BYTES = 24  # and per node of the mask analysed (see `analysis_bytes`)

# --- The generic range analysis (`maskc.lowering.generic.range_analysis`).

LEAF_CHUNK = 1 << 15  # rectangles analysed at a time: bounds the analysis's work arrays
MIN_ROUND = 256  # rectangles a round must have room for (fewer when fewer are left): rounds
# of a few would crawl through the rest of the work only to fail the budget later
RECT_BYTES = 800  # per rectangle of a round beside its analysis: bounds, states, and up to
# 16 children (`_split` cuts each side in 4 in a round of few rectangles) of 40 bytes
PIECE_BYTES = 96  # per operand piece of a strip beside its analysis: its line and bounds
EXPANDED_RUN_BYTES = 64  # per run of single lines expanded from the leaves, sorted and merged
STRIP_PARTS = 8  # parts a long strip of tiles without hints is cut into at once: a boundary
# crosses it at few places, so most parts are decided at once (a third of the rounds)
SIDE_PARTS = 4  # parts each side of a rectangle without hints is cut into, in a round of few:
# a boundary is followed down to single tiles in half the rounds
FEW_RECTS = 256  # rectangles a round may have for that (its cost is then mostly fixed)
SMALL_COVER = 4  # rectangles of the operands' tile cover of at most this many tiles start as
# single tiles: rounds of halving would reach them anyway, one round per halving

# --- Sampling pairs of tiles PARTIAL in two parts (`maskc.lowering.generic.sampling`).

SAMPLE_CHUNK = 1 << 16  # tiles sampled at a time: bounds the pairs evaluated at once
SAMPLE_BYTES = 512  # working memory per tile sampled (five pairs, their positions and reads)
SAMPLE_GROUP = 4  # pairs a tile evaluates at once, each with a value per node of the mask

# --- Lowering an `&` / `|` in parts (rule `parts`, `maskc.lowering.generic.combination`).

WHOLE_AFTER = 0.25  # operand changes per tile row above which an `&` is lowered whole: past
# it the whole `&` prunes its operand items by its periodic ones faster than parts combine
COMBINE_CHUNK = 1 << 15  # runs combined at a time: bounds the combiner's working memory
DECIDED_TILE_BYTES = 128  # working memory per tile of a piece decided tile by tile
SPLICE_SORTED_AFTER = 2  # pattern runs looked at per run of x above which `_splice` sorts
# out those inside x's FULL runs (fewer: as fast to combine them all)
COMBINE_RUN_BYTES = 128  # working memory per run combined: their cuts, pieces and states
MET_LINE_BYTES = 9 * 64  # per line of bounds met: nine pieces, their keys, states, cuts
WAITING_PIECE_BYTES = 40  # per piece waiting to be decided with others, and their concatenation

# --- Closed forms (`maskc.lowering.closed_forms`).

CUT_BYTES = 64  # per token where a read of one axis changes: its keys, position, batch row,
# value (`axis_reads`)
SLOT_BYTES = 16  # per slot of a pattern's packed rows: start, stop, state, and a flag, with
# room (`pattern_lines`)
GRID_TRANSPOSE_COVER = 8  # the most grid cells per tile covered for which columns' runs are
# turned into rows' runs through the dense grid of tile states, not by expanding their tiles
# (`maskc.lowering.grid.run_lists.transposed_through_grid`; rule `tree`): at 64K tokens and
# 4.3 cells a tile the grid took 0.43 ms against 1.67 ms, so it breaks even near 16
GRID_CELL_BYTES = 8  # working memory per cell of that grid: the two XORed, their prefix, the
# neighbours compared, flags

# --- The traced lowering (`maskc.lowering.traced`).

MAX_CUTS = 4  # operand changes a tile line may be cut at: a fixed shape under `jit`
SUB_PARTS = 4  # and equal parts it is cut into (the static path's 4 x 4 sub-rectangles)
PIECE_ROUND = 128  # ambiguous tiles decided by pieces per round: each round cuts its tiles'
# lines only, so few tiles make few lines
FEW_RUNS = 8  # runs per tile line listed without a sort where no line has more
MANY_RUNS = 64  # and, where some line has more, in a second try from the same bit words:
# block selection (a query block's top-k, a key block many query blocks chose) fits it
BIT_LINES = (128, 1024)  # tiles a line has for its runs read from bit words (4 to 32 words)
STATIC_PART_TILES = 1 << 20  # the most tiles of an operand-free part lowered to a constant
# grid: bounds the constant the traced program carries
LIST_GROUP = 32  # flags per group when listing a few of many (`_listed`)
# XLA's memory per tile of a traced lowering, an upper bound: its temporaries (6-19 bytes a
# tile by XLA's own memory analysis of the compiled lowering on a CPU, the grid's fused
# analysis and the refinement's rounds) and the runs along both axes (18 bytes);
# `tests/test_memory_budget.py` checks it against that analysis.
TILE_BYTES = 64
# Of the widened band (`maskc.lowering.closed_forms.widened_traced`): both axes' runs, 18 bytes
# a tile, and their slots padded once (5 by XLA's memory analysis); its lines' reductions need
# 32 bytes a token.
WIDENED_TILE_BYTES = 32
