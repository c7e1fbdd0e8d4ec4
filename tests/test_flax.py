"""maskc.flax.Attention: the NNX module against an independent NumPy attention, Flax's own
MultiHeadAttention, and itself: prefill then step-by-step decoding equals the full forward,
also for a ragged batch (prompts of different lengths, one cache index per row).

The reference is written here: float64 NumPy softmax attention over the dense mask
`maskc.materialize` gives, with GQA by repeating key/value heads.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import maskc  # noqa: E402
from maskc.flax import Attention  # noqa: E402

F = 16  # in_features


def reference(attn: Attention, x, allowed, sinks=None, positions=None, rope=None, x_kv=None,
              norm=None):
  """float64 NumPy attention with the module's weights; `allowed` `[B?, H?, L, S]`; keys and
  values from `x_kv` (cross-attention) when given; `norm(q, k) -> (q, k)` after projecting."""
  x = np.asarray(x, np.float64)
  x_kv = x if x_kv is None else np.asarray(x_kv, np.float64)
  p = {n: np.asarray(getattr(attn, n).kernel[...], np.float64)
       for n in ("query", "key", "value", "out")}
  b = {n: np.asarray(getattr(attn, n).bias[...], np.float64)
       for n in ("query", "key", "value", "out")}
  q = np.einsum("bli,ihd->blhd", x, p["query"]) + b["query"]
  k = np.einsum("bli,ihd->blhd", x_kv, p["key"]) + b["key"]
  v = np.einsum("bli,ihd->blhd", x_kv, p["value"]) + b["value"]
  if norm is not None:
    q, k = norm(q, k)
  if rope is not None:
    pos = np.broadcast_to(np.arange(x.shape[1]) if positions is None else positions,
                          x.shape[:2])
    q, k = np.asarray(rope(q, pos)), np.asarray(rope(k, pos))
  h, hkv = q.shape[2], k.shape[2]
  k, v = np.repeat(k, h // hkv, axis=2), np.repeat(v, h // hkv, axis=2)
  logits = np.einsum("blhd,bshd->bhls", q, k) / np.sqrt(q.shape[-1])
  if attn.logits_soft_cap is not None:
    logits = attn.logits_soft_cap * np.tanh(logits / attn.logits_soft_cap)
  allowed = np.asarray(allowed, bool)
  if allowed.ndim == 2:
    allowed = allowed[None, None]
  elif allowed.ndim == 3 and allowed.shape[0] == h and x.shape[0] != h:
    allowed = allowed[None]
  elif allowed.ndim == 3:
    allowed = allowed[:, None]
  logits = np.where(allowed, logits, -np.inf)
  m = logits.max(-1, keepdims=True)
  if sinks is not None:
    m = np.maximum(m, np.asarray(sinks, np.float64)[None, :, None, None])
  e = np.where(allowed, np.exp(logits - m), 0.0)
  denom = e.sum(-1, keepdims=True)
  if sinks is not None:
    denom = denom + np.exp(np.asarray(sinks, np.float64)[None, :, None, None] - m)
  o = np.einsum("bhls,bshd->blhd", e / denom, v)
  return np.einsum("blhd,hdo->blo", o, p["out"]) + b["out"]


def rope(x, positions):
  """Rotary embeddings (half-split), the hook a model's RoPE fills; NumPy in, NumPy out."""
  xp = np if isinstance(x, np.ndarray) else jnp
  half = x.shape[-1] // 2
  freq = 1.0 / (10000.0 ** (xp.arange(half) / half))
  angle = xp.asarray(positions).astype(x.dtype)[..., None, None] * freq
  x1, x2 = x[..., :half], x[..., half:]
  cos, sin = xp.cos(angle), xp.sin(angle)
  return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def random_bias(attn: Attention, seed: int) -> None:
  """Nonzero biases, so a test sees them (Flax initializes them to zero)."""
  rng = np.random.default_rng(seed)
  for n in ("query", "key", "value", "out"):
    bias = getattr(attn, n).bias
    bias[...] = jnp.asarray(rng.standard_normal(bias[...].shape) * 0.1, jnp.float32)


def inputs(batch: int, length: int, seed: int = 1):
  return jax.random.normal(jax.random.key(seed), (batch, length, F), jnp.float32)


# ---------------------------------------------------------------------- the forward

FORWARD = [
    ("causal", {}),
    ("sliding(5)", {}),
    ("causal & chunk(4) | bidirectional(img)", {"img": True}),
    ("causal & document(seg)", {"seg": True}),
]


def operand_values(names, batch, length):
  seg = np.repeat(np.arange(3), -(-length // 3))[:length].astype(np.int32)
  img = np.zeros(length, bool)
  img[2:7] = True
  values = {"seg": np.stack([seg, np.roll(seg, 2)])[:batch], "img": img}
  return {n: values[n] for n in names}


@pytest.mark.parametrize("text,ops,kv_heads", [f + (h,) for f, h in zip(FORWARD, [4, 2, 1, 2])])
def test_forward_matches_the_dense_reference(text, ops, kv_heads):
  attn = Attention(4, F, num_kv_heads=kv_heads, mask=text, rngs=nnx.Rngs(0))
  random_bias(attn, 1)
  x = inputs(2, 12)
  operands = operand_values(ops, 2, 12)
  allowed = maskc.materialize(text, 12, operands=operands)
  np.testing.assert_allclose(attn(x, operands=operands), reference(attn, x, allowed),
                             atol=2e-5, rtol=2e-5)


def test_per_head_masks_soft_cap_sinks_and_rope():
  heads = ["causal", "sliding(3)", "causal & chunk(4)", "causal"]
  attn = Attention(4, F, num_kv_heads=2, mask=heads, logits_soft_cap=2.0, sinks=True,
                   rope=rope, rngs=nnx.Rngs(0))
  attn.sink_logits[...] = jnp.asarray([0.5, -1.0, 0.0, 2.0])
  x = inputs(2, 10)
  allowed = maskc.materialize(heads, 10)
  want = reference(attn, x, allowed, sinks=attn.sink_logits[...], rope=rope)
  np.testing.assert_allclose(attn(x), want, atol=2e-5, rtol=2e-5)


def test_positions_move_the_mask_and_the_rotation():
  attn = Attention(2, F, mask="sliding(3)", rope=rope, rngs=nnx.Rngs(0))
  x = inputs(1, 8)
  positions = np.array([3, 0, 6, 1, 4, 7, 2, 5], np.int32)  # stored out of order
  allowed = maskc.materialize("sliding(3)", 8, q_positions=positions, kv_positions=positions)
  want = reference(attn, x, allowed, positions=positions, rope=rope)
  np.testing.assert_allclose(attn(x, positions=positions), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_same_output_as_nnx_multihead_attention(kv_heads):
  theirs = nnx.MultiHeadAttention(4, F, num_kv_heads=kv_heads, decode=False,
                                  rngs=nnx.Rngs(3))
  ours = Attention(4, F, num_kv_heads=kv_heads, mask="causal & document(seg)",
                   rngs=nnx.Rngs(0))
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  random_bias(ours, 2)
  nnx.update(theirs, nnx.state(ours, nnx.Param))
  x = inputs(2, 12)
  seg = operand_values(["seg"], 2, 12)["seg"]
  dense = maskc.materialize("causal & document(seg)", 12, operands={"seg": seg})
  np.testing.assert_allclose(ours(x, operands={"seg": seg}),
                             theirs(x, mask=jnp.asarray(dense)[:, None]), atol=2e-5, rtol=2e-5)


def test_gradients_through_nnx_grad():
  attn = Attention(4, F, num_kv_heads=2, mask="sliding(4)", sinks=True, rngs=nnx.Rngs(0))
  x = inputs(2, 9)
  grads = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(attn)
  allowed = maskc.materialize("sliding(4)", 9)
  names = ("query", "key", "value", "out")

  def loss(params):  # the reference in jax.numpy, over the same parameters
    q = jnp.einsum("bli,ihd->blhd", x, params["query"])
    k = jnp.repeat(jnp.einsum("bli,ihd->blhd", x, params["key"]), 2, axis=2)
    v = jnp.repeat(jnp.einsum("bli,ihd->blhd", x, params["value"]), 2, axis=2)
    logits = jnp.einsum("blhd,bshd->bhls", q, k) / np.sqrt(q.shape[-1])
    logits = jnp.where(allowed, logits, -jnp.inf)
    sinks = jnp.broadcast_to(params["sinks"][None, :, None, None], logits.shape[:3] + (1,))
    p = jax.nn.softmax(jnp.concatenate([logits, sinks], -1), -1)[..., :-1]
    o = jnp.einsum("bhls,bshd->blhd", p, v)
    return jnp.sum(jnp.sin(jnp.einsum("blhd,hdo->blo", o, params["out"])))

  params = {n: getattr(attn, n).kernel[...] for n in names}
  params["sinks"] = attn.sink_logits[...]
  want = jax.grad(loss)(params)
  for n in names:
    np.testing.assert_allclose(getattr(grads, n).kernel[...], want[n], atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(grads.sink_logits[...], want["sinks"], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- decoding


def decode_all(attn: Attention, x, prompt: int, operands=None, step_operands=None, step=None):
  """Prefill `prompt` tokens then decode the rest one by one; the rows, concatenated."""
  attn.init_cache((x.shape[0], x.shape[1] + 3, F))
  call = step or (lambda m, t, ops: m(t, operands=ops, decode=True))
  outs = [call(attn, x[:, :prompt], operands or {})]
  for t in range(prompt, x.shape[1]):
    ops = {n: v[..., t:t + 1] for n, v in (step_operands or {}).items()}
    outs.append(call(attn, x[:, t:t + 1], ops))
  return jnp.concatenate(outs, axis=1)


MASKS = {
    "causal": ("causal", None),
    "sliding": ("sliding(W)", None),
    "chunk": ("causal & chunk(W)", None),
    "documents": ("causal & document(seg)", "seg"),
    "sliding documents": ("sliding(W) & document(seg)", "seg"),
    "images": ("causal | bidirectional(img)", "img"),
    "gemma3 local": ("sliding(W) | bidirectional(img)", "img"),
    "prefix-LM": ("causal | prefix(n)", "n"),
}


def check_decode_law(name, window, prompt, length, kv_heads, with_rope, data):
  """Prefill of `prompt` tokens then decoding to `length` equals the full forward."""
  text, operand = MASKS[name]
  ops: dict[str, np.ndarray] = {}
  prompt_ops: dict[str, np.ndarray] = {}
  cache_window: int | str | None = "auto"
  if operand == "seg":  # documents in the prompt; generated tokens continue the last one
    cuts = np.sort(data.draw(st.lists(st.integers(0, prompt), max_size=3)))
    seg = np.searchsorted(cuts, np.arange(length), side="right").astype(np.int32)
    seg[prompt:] = seg[prompt - 1]
    ops, prompt_ops = {"seg": seg}, {"seg": seg[:prompt]}
  elif operand == "img":  # an image span in the prompt; generated tokens are text
    a = data.draw(st.integers(0, prompt - 1))
    span = data.draw(st.integers(1, min(window + 1, prompt - a)))
    img = np.zeros(length, bool)
    img[a:a + span] = True
    ops, prompt_ops = {"img": img}, {"img": img[:prompt]}
    if name == "gemma3 local":
      cache_window = window + 1  # vouched for: the image is prefilled in one call
  elif operand == "n":
    n = data.draw(st.integers(0, prompt))
    ops, prompt_ops = {"n": np.int32(n)}, {"n": np.int32(n)}
  attn = Attention(4, F, num_kv_heads=kv_heads, mask=text,
                   mask_params={"W": window} if "W" in text else None,
                   cache_window=cache_window, rope=rope if with_rope else None,
                   rngs=nnx.Rngs(0))
  x = inputs(2, length, seed=prompt)
  full = attn(x, operands=ops)
  decoded = decode_all(attn, x, prompt, prompt_ops)
  np.testing.assert_allclose(decoded, full, atol=3e-5, rtol=3e-5)
  if name in ("sliding", "chunk", "sliding documents"):
    assert attn.cached_key[...].shape[1] == min(window, length + 3)  # a ring of W slots
  elif name != "gemma3 local":
    assert attn.cached_key[...].shape[1] == length + 3  # a global layer keeps every token


@settings(max_examples=3, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(MASKS)), st.integers(1, 4), st.integers(1, 9), st.booleans(),
       st.data())
def test_prefill_then_decode_equals_the_forward(name, window, prompt, with_rope, data):
  # One length and one GQA layout: eager jax compiles each new shape once, so examples of
  # the same shapes stay fast. The slow test below draws those too.
  check_decode_law(name, window, prompt, 10, 2, with_rope, data)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(MASKS)), st.integers(1, 6), st.integers(1, 14),
       st.integers(1, 6), st.sampled_from([4, 2, 1]), st.booleans(), st.data())
def test_prefill_then_decode_equals_the_forward_at_drawn_shapes(name, window, prompt, steps,
                                                                kv_heads, with_rope, data):
  check_decode_law(name, window, prompt, prompt + steps, kv_heads, with_rope, data)


def test_one_jitted_step_serves_every_position():
  attn = Attention(4, F, num_kv_heads=2, mask="sliding(3) | bidirectional(img)",
                   cache_window=4, rope=rope, rngs=nnx.Rngs(0))
  traces = []

  @nnx.jit
  def step(m, tokens, ops):
    traces.append(tokens.shape)
    return m(tokens, operands=ops, decode=True)

  x = inputs(2, 14)
  img = np.zeros(14, bool)
  img[1:4] = True
  full = attn(x, operands={"img": img})
  decoded = decode_all(attn, x, 5, {"img": img[:5]}, step=step)
  np.testing.assert_allclose(decoded, full, atol=3e-5, rtol=3e-5)
  assert traces == [(2, 5, F), (2, 1, F)], traces  # the prefill, then one step for all
  assert int(attn.cache_index[...]) == 14


def test_step_operands_are_written_at_their_positions():
  """A document boundary given while decoding, and a new image token, take effect."""
  text = "causal & document(seg) | bidirectional(img)"
  attn = Attention(4, F, num_kv_heads=2, mask=text, rngs=nnx.Rngs(0))
  x = inputs(2, 10)  # the shapes of the decode law above: eager jax reuses its compilations
  seg = np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3], np.int32)
  img = np.array([0, 1, 1, 0, 0, 0, 0, 0, 0, 1], bool)
  full = attn(x, operands={"seg": seg, "img": img})
  decoded = decode_all(attn, x, 4, {"seg": seg[:4], "img": img[:4]},
                       step_operands={"seg": seg, "img": img})
  np.testing.assert_allclose(decoded, full, atol=3e-5, rtol=3e-5)


def test_window_is_the_proven_lookback():
  def window(mask, **kw):
    return Attention(len(mask) if isinstance(mask, list) else 2, F, mask=mask,
                     rngs=nnx.Rngs(0), **kw).window

  assert window("causal") is None
  assert window("sliding(5)") == 5
  assert window("causal & chunk(4)") == 4
  assert window("sliding(8) & chunk(4)") == 4
  assert window("sliding(8) & document(seg)") == 8
  assert window("sliding(8) | bidirectional(img)") is None  # images may reach further
  assert window("sliding(8) | sink(4)") is None
  assert window(["sliding(4)", "sliding(6)"]) == 6
  assert window(["sliding(4)", "causal"]) is None
  assert window("sliding(5)", cache_window=None) is None
  assert window("causal", cache_window=7) == 7


# ---------------------------------------------------------------------- ragged batches


def check_ragged_decode_law(text, window, prompts, generate, data_seed):
  """Rows of different lengths: a right-padded prefill with `lengths`, then one jitted step
  for every token, each row at its own position (a row with nothing left passes length 0).
  Each row's outputs equal the reference attention over that row's own tokens alone, so the
  junk in the padding is never attended; padding rows attend nothing."""
  batch = len(prompts)
  totals = [p + g for p, g in zip(prompts, generate)]
  rng = np.random.default_rng(data_seed)
  rows = [rng.standard_normal((t, F)).astype(np.float32) for t in totals]
  segs = [np.sort(rng.integers(0, 3, t)).astype(np.int32) for t in totals]
  reads_seg = "seg" in text
  attn = Attention(4, F, num_kv_heads=2, mask=text,
                   mask_params={"W": window} if "W" in text else None, rope=rope,
                   rngs=nnx.Rngs(0))
  random_bias(attn, 3)
  attn.init_cache((batch, max(totals) + 2, F), ragged=True)
  traces = []

  @nnx.jit
  def call(m, tokens, lengths, ops):
    traces.append(tokens.shape)
    return m(tokens, operands=ops, lengths=lengths, decode=True)

  width = max(prompts)
  tokens = np.full((batch, width, F), 50.0, np.float32)  # padding: junk, never attended
  seg = np.full((batch, width), 7, np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :p], seg[b, :p] = rows[b][:p], segs[b][:p]
  y = call(attn, tokens, np.asarray(prompts, np.int32), {"seg": seg} if reads_seg else {})
  outs = [[np.asarray(y[b, :p])] for b, p in enumerate(prompts)]
  for b, p in enumerate(prompts):  # padding rows attend nothing: the out projection's bias
    np.testing.assert_allclose(y[b, p:], np.broadcast_to(attn.out.bias[...], (width - p, F)),
                               atol=1e-6)
  for t in range(max(generate)):
    live = [t < g for g in generate]
    tok = np.stack([rows[b][prompts[b] + t] if live[b] else np.full(F, 50.0, np.float32)
                    for b in range(batch)])[:, None]
    step_seg = np.asarray([[segs[b][prompts[b] + t] if live[b] else 7] for b in range(batch)],
                          np.int32)
    y = call(attn, tok, np.asarray(live, np.int32), {"seg": step_seg} if reads_seg else {})
    for b in range(batch):
      if live[b]:
        outs[b].append(np.asarray(y[b]))
  shapes = [(batch, width, F)] + ([(batch, 1, F)] if max(generate) else [])
  assert traces == list(dict.fromkeys(shapes)), traces  # one step serves every row
  np.testing.assert_array_equal(attn.cache_index[...], totals)
  for b in range(batch):
    ops = {"seg": segs[b]} if reads_seg else {}
    allowed = maskc.materialize(attn.mask.mask, totals[b], operands=ops)
    want = reference(attn, rows[b][None], allowed, rope=rope)[0]
    np.testing.assert_allclose(np.concatenate(outs[b]), want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("text,prompts,generate", [
    ("causal & document(seg)", [2, 5, 4], [3, 1, 2]),  # a global cache, documents per row
    ("sliding(W)", [1, 6, 3], [2, 3, 0]),  # a ring of 3 slots, prompts longer than it
])
def test_ragged_batch_decodes_each_row_as_its_own_forward(text, prompts, generate):
  check_ragged_decode_law(text, 3, prompts, generate, data_seed=sum(prompts))


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(st.sampled_from(sorted(MASKS)), st.integers(1, 5),
       st.lists(st.tuples(st.integers(1, 8), st.integers(0, 4)), min_size=1, max_size=3),
       st.integers(0, 2**16))
def test_ragged_decode_law_at_drawn_shapes(name, window, rows, seed):
  text, operand = MASKS[name]
  if operand not in (None, "seg"):
    text = text.replace(" | bidirectional(img)", "").replace(" | prefix(n)", "")
  prompts, generate = [p for p, _ in rows], [g for _, g in rows]
  check_ragged_decode_law(text, window, prompts, generate, seed)


# ---------------------------------------------------------------------- nnx.MultiHeadAttention


def carry_weights(ours: Attention, theirs: nnx.MultiHeadAttention, seed: int) -> None:
  """Flax's weights into ours, then random biases and norm scales into both."""
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  random_bias(ours, seed)
  rng = np.random.default_rng(seed)
  for ln in (ours.query_ln, ours.key_ln):
    if ln is not None:
      ln.scale[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(ln.scale[...].shape),
                                  jnp.float32)
  nnx.update(theirs, nnx.state(ours, nnx.Param))


CROSS = "qseg[q] == kseg[k] & k < n"  # packed encoder-decoder pairs, encoder padding


def cross_operands():
  return {"qseg": np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]], np.int32),
          "kseg": np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2, 2, 2]],
                           np.int32),
          "n": np.array([8, 9], np.int32)}


def cross_pair(seed: int = 4):
  """Flax's cross-attention and ours (q_len 5 over kv_len 9 of another width, GQA, QK
  LayerNorm) with the same weights; the inputs, operands and Flax's dense mask."""
  theirs = nnx.MultiHeadAttention(4, F, in_kv_features=12, num_kv_heads=2, normalize_qk=True,
                                  decode=False, rngs=nnx.Rngs(3))
  ours = Attention(4, F, in_kv_features=12, num_kv_heads=2, mask=CROSS, normalize_qk=True,
                   rngs=nnx.Rngs(0))
  carry_weights(ours, theirs, seed)
  xq = inputs(2, 5)
  xkv = jax.random.normal(jax.random.key(2), (2, 9, 12), jnp.float32)
  ops = cross_operands()
  dense = jnp.asarray(maskc.materialize(CROSS, 5, 9, q_offset=0, operands=ops))[:, None]
  return ours, theirs, xq, xkv, ops, dense


def test_cross_attention_and_normalize_qk_match_nnx_multihead_attention():
  ours, theirs, xq, xkv, ops, dense = cross_pair()
  # One compilation, rather than eager jax's one per operation.
  got, want = nnx.jit(lambda a, b: (a(xq, xkv, operands=ops), b(xq, xkv, mask=dense)))(
      ours, theirs)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_cross_attention_gradients_match_nnx_multihead_attention():
  ours, theirs, xq, xkv, ops, dense = cross_pair(seed=6)

  def loss(m, call):
    y = call(m)
    return jnp.sum(jnp.sin(y)), y

  @nnx.jit
  def outputs_and_grads(ours, theirs):
    grad = nnx.grad(loss, has_aux=True)
    return (grad(ours, lambda m: m(xq, xkv, operands=ops)),
            grad(theirs, lambda m: m(xq, xkv, mask=dense)))

  (g_ours, y_ours), (g_theirs, y_theirs) = outputs_and_grads(ours, theirs)
  np.testing.assert_allclose(y_ours, y_theirs, atol=2e-5, rtol=2e-5)
  for name in ("query", "key", "value", "out"):
    np.testing.assert_allclose(getattr(g_ours, name).kernel[...],
                               getattr(g_theirs, name).kernel[...], atol=1e-4, rtol=1e-4)
  for name in ("query_ln", "key_ln"):
    np.testing.assert_allclose(getattr(g_ours, name).scale[...],
                               getattr(g_theirs, name).scale[...], atol=1e-4, rtol=1e-4)


def test_cross_attention_positions_and_rms_norm():
  """Given query and key positions move the mask; an RMSNorm of q and k per head."""
  attn = Attention(2, F, in_kv_features=12, mask="sliding(3)", normalize_qk="rms",
                   rngs=nnx.Rngs(0))
  xq = inputs(1, 3)
  xkv = jax.random.normal(jax.random.key(2), (1, 7, 12), jnp.float32)
  q_pos, kv_pos = np.array([4, 5, 6]), np.array([6, 0, 1, 2, 3, 4, 5])
  allowed = maskc.materialize("sliding(3)", 3, 7, q_positions=q_pos, kv_positions=kv_pos)

  def rms(q, k):
    def one(x, scale):
      return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * scale
    return (one(q, np.asarray(attn.query_ln.scale[...])),
            one(k, np.asarray(attn.key_ln.scale[...])))

  attn.key_ln.scale[...] = jnp.linspace(0.5, 1.5, attn.head_dim)
  # Without positions, queries and keys both count from 0.
  at_zero = maskc.materialize("sliding(3)", 3, 7, q_offset=0)
  got, got_at_zero = nnx.jit(lambda m: (m(xq, xkv, positions=q_pos, kv_positions=kv_pos),
                                        m(xq, xkv)))(attn)
  np.testing.assert_allclose(got, reference(attn, xq, allowed, x_kv=xkv, norm=rms),
                             atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(got_at_zero, reference(attn, xq, at_zero, x_kv=xkv, norm=rms),
                             atol=2e-5, rtol=2e-5)


def test_dropout_and_sown_weights_match_nnx_multihead_attention():
  """The same dropout keys drop the same weights; the sown weights are Flax's."""
  kw = dict(num_kv_heads=2, dropout_rate=0.3, rngs=nnx.Rngs(3))
  theirs = nnx.MultiHeadAttention(4, F, decode=False, **kw)
  ours = Attention(4, F, mask="causal", backend="dense", **kw)
  carry_weights(ours, theirs, 5)
  x = inputs(2, 6)
  dense = jnp.asarray(maskc.materialize("causal", 6))

  @nnx.jit
  def calls(ours, theirs):
    dropped = (ours(x, deterministic=False, rngs=nnx.Rngs(dropout=7), sow_weights=True),
               theirs(x, mask=dense, deterministic=False, rngs=nnx.Rngs(dropout=7),
                      sow_weights=True))
    kept = ours(x, deterministic=True), theirs(x, mask=dense, deterministic=True)
    # The module's own keys, kept from construction, drop other weights.
    own = ours(x, deterministic=False)
    return dropped, kept, own

  dropped, kept, own = calls(ours, theirs)
  np.testing.assert_allclose(*dropped, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(ours.attention_weights.get_value()[0],
                             theirs.attention_weights.get_value()[0], atol=1e-6)
  # Deterministic calls take the kernels' path and agree with Flax's too.
  np.testing.assert_allclose(*kept, atol=2e-5, rtol=2e-5)
  assert not np.allclose(own, dropped[0])


@pytest.mark.slow
def test_dropout_gradients_match_nnx_multihead_attention():
  """Training with dropout: the same keys give Flax's gradients, per-head dropout too."""
  kw = dict(num_kv_heads=2, dropout_rate=0.2, broadcast_dropout=False, rngs=nnx.Rngs(3))
  theirs = nnx.MultiHeadAttention(4, F, decode=False, **kw)
  ours = Attention(4, F, mask="sliding(4)", backend="dense", **kw)
  carry_weights(ours, theirs, 7)
  x = inputs(2, 7)
  dense = jnp.asarray(maskc.materialize("sliding(4)", 7))

  def loss(m, call):
    return jnp.sum(jnp.sin(call(m)))

  @nnx.jit
  def grads(ours, theirs):
    return (nnx.grad(loss)(ours, lambda m: m(x, deterministic=False,
                                             rngs=nnx.Rngs(dropout=11))),
            nnx.grad(loss)(theirs, lambda m: m(x, mask=dense, deterministic=False,
                                               rngs=nnx.Rngs(dropout=11))))

  g_ours, g_theirs = grads(ours, theirs)
  for name in ("query", "key", "value", "out"):
    np.testing.assert_allclose(getattr(g_ours, name).kernel[...],
                               getattr(g_theirs, name).kernel[...], atol=1e-4, rtol=1e-4)


def test_sow_weights_while_decoding_with_sinks():
  """The sown weights of a decode step are over the cache's slots, sinks taking their
  share; any backend serves sow_weights."""
  attn = Attention(2, F, mask="sliding(3)", sinks=True, rngs=nnx.Rngs(0))
  attn.sink_logits[...] = jnp.asarray([0.5, -1.0])
  x = inputs(1, 5)
  attn.init_cache((1, 8, F))

  @nnx.jit
  def run(m, x):
    m(x[:, :4], decode=True)
    return m(x[:, 4:], decode=True, sow_weights=True)

  y = run(attn, x)
  (weights,) = attn.attention_weights.get_value()
  assert weights.shape == (1, 2, 1, 3 + 1)  # the ring's 3 slots and the call's own key
  want = reference(attn, x, maskc.materialize("sliding(3)", 5), sinks=attn.sink_logits[...])
  np.testing.assert_allclose(y, want[:, 4:], atol=3e-5, rtol=3e-5)
  sink_share = 1 - weights.sum(-1)
  assert np.all(sink_share > 0) and np.all(sink_share < 1)
  np.testing.assert_array_equal(np.count_nonzero(weights, -1), 3)  # a window of 3 keys


# ---------------------------------------------------------------------- errors


def test_errors_say_what_to_do():
  x = inputs(1, 4)
  attn = Attention(2, F, mask="causal & document(seg)", rngs=nnx.Rngs(0))
  with pytest.raises(maskc.MaskValueError, match="init_cache"):
    attn(x, decode=True)
  attn.init_cache((1, 8, F))
  with pytest.raises(maskc.MaskValueError, match="cache supplies them"):
    attn(x, positions=np.arange(4), decode=True)
  with pytest.raises(maskc.OperandError, match="reads no operand `img`"):
    attn(x, operands={"img": np.zeros(4, bool)}, decode=True)
  with pytest.raises(maskc.OperandError, match=r"\[4\] or \[1, 4\]"):
    attn(x, operands={"seg": np.zeros(8, np.int32)}, decode=True)
  with pytest.raises(maskc.MaskValueError, match="do not fit"):
    attn(inputs(1, 9), decode=True)
  with pytest.raises(maskc.MaskValueError, match="takes \\[B, L, 16\\]"):
    attn(jnp.ones((4, F)))
  with pytest.raises(maskc.OperandError, match="pairwise operand `anc`"):
    Attention(2, F, mask="causal & anc[q, k]", rngs=nnx.Rngs(0)).init_cache((1, 8, F))
  with pytest.raises(maskc.MaskValueError, match="3 entries for num_heads=2"):
    Attention(2, F, mask=["causal"] * 3, rngs=nnx.Rngs(0))
  with pytest.raises(maskc.MaskValueError, match="not a multiple of num_kv_heads=2"):
    Attention(3, 18, num_kv_heads=2, rngs=nnx.Rngs(0))
  with pytest.raises(maskc.MaskValueError, match="cache_window"):
    Attention(2, F, cache_window=0, rngs=nnx.Rngs(0))
  with pytest.raises(maskc.MaskNameError, match="slidng"):
    Attention(2, F, mask="slidng(4)", rngs=nnx.Rngs(0))


def test_errors_of_cross_attention_dropout_and_ragged_caches():
  x = inputs(1, 4)
  with pytest.raises(maskc.BackendError, match="backend='dense'"):
    Attention(2, F, dropout_rate=0.1, rngs=nnx.Rngs(0))
  with pytest.raises(maskc.MaskValueError, match=r"\[0, 1\)"):
    Attention(2, F, dropout_rate=1.0, backend="dense", rngs=nnx.Rngs(0))
  with pytest.raises(maskc.MaskValueError, match="normalize_qk"):
    Attention(2, F, normalize_qk="batch", rngs=nnx.Rngs(0))
  dropping = Attention(2, F, dropout_rate=0.1, backend="dense", keep_rngs=False,
                       rngs=nnx.Rngs(0))
  with pytest.raises(maskc.MaskValueError, match="deterministic"):
    dropping(x)
  with pytest.raises(maskc.MaskValueError, match="keep_rngs"):
    dropping(x, deterministic=False)
  attn = Attention(2, F, rngs=nnx.Rngs(0))
  with pytest.raises(maskc.MaskValueError, match="without inputs_k"):
    attn(x, inputs_v=x)
  with pytest.raises(maskc.MaskValueError, match="kv_positions are for cross-attention"):
    attn(x, kv_positions=np.arange(4))
  with pytest.raises(maskc.MaskValueError, match="lengths were given without decode"):
    attn(x, lengths=np.array([4]))
  with pytest.raises(maskc.MaskValueError, match=r"inputs_k has shape \(1, 4, 8\)"):
    attn(x, jnp.ones((1, 4, 8)))
  attn.init_cache((1, 8, F))
  with pytest.raises(maskc.MaskValueError, match="cross-attention keys"):
    attn(x, x, decode=True)
  with pytest.raises(maskc.MaskValueError, match="ragged=True"):
    attn(x, lengths=np.array([2]), decode=True)
  attn.init_cache((1, 8, F), ragged=True)
  with pytest.raises(maskc.MaskValueError, match=r"lengths has shape \(2,\)"):
    attn(x, lengths=np.array([2, 2]), decode=True)
  with pytest.raises(maskc.MaskValueError, match=r"not all in 0..4"):
    attn(x, lengths=np.array([5]), decode=True)
  with pytest.raises(maskc.MaskValueError, match="in_kv_features=12"):
    Attention(2, F, in_kv_features=12, rngs=nnx.Rngs(0))(x)


def test_the_package_imports_flax_and_maskc_public_api_only():
  folder = pathlib.Path(maskc.__file__).parent / "flax"
  seen = set()
  for path in folder.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.ImportFrom) and node.module:
        seen.add(node.module)
      elif isinstance(node, ast.Import):
        seen.update(a.name for a in node.names)
  ours = {m for m in seen if m.split(".")[0] == "maskc"}
  assert {m for m in ours if m != "maskc" and not m.startswith("maskc.flax")} == set(), ours
  assert {m.split(".")[0] for m in seen} <= {"__future__", "collections", "typing", "jax",
                                             "numpy", "flax", "maskc"}
