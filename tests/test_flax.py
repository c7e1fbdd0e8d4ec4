"""maskc.flax.Attention: the NNX module against an independent NumPy attention, Flax's own
MultiHeadAttention, and itself: prefill then step-by-step decoding equals the full forward.

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


def reference(attn: Attention, x, allowed, sinks=None, positions=None, rope=None):
  """float64 NumPy attention with the module's weights; `allowed` `[B?, H?, L, S]`."""
  x = np.asarray(x, np.float64)
  p = {n: np.asarray(getattr(attn, n).kernel[...], np.float64)
       for n in ("query", "key", "value", "out")}
  b = {n: np.asarray(getattr(attn, n).bias[...], np.float64)
       for n in ("query", "key", "value", "out")}
  q = np.einsum("bli,ihd->blhd", x, p["query"]) + b["query"]
  k = np.einsum("bli,ihd->blhd", x, p["key"]) + b["key"]
  v = np.einsum("bli,ihd->blhd", x, p["value"]) + b["value"]
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
