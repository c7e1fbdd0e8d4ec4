"""Float64 NumPy attention scores, shared by the kernel tests' independent references."""

from __future__ import annotations

import numpy as np


def numpy_scores(q, k, allowed, scale: float, cap: float | None) -> np.ndarray:
  """Scores `[B, H, Lq, Lk]` in float64: GQA key heads repeated, soft cap, -inf where not allowed."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  if cap is not None:
    s = cap * np.tanh(s / cap)
  return np.where(allowed, s, -np.inf)


def repeat_kv(v, q_heads: int) -> np.ndarray:
  """Value heads repeated to the query heads (GQA), in float64."""
  v = np.asarray(v, np.float64)
  return np.repeat(v, q_heads // v.shape[2], axis=2)
