"""`maskc.flax.Attention`: multi-head attention as an NNX module, its mask compiled by maskc."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers

import maskc
from maskc.flax import _cache

Array = jax.Array
Initializer = Callable[..., Array]
Rope = Callable[[Array, Array], Array]
MaskArg = str | maskc.Mask | maskc.MaskSpec | Sequence[str | maskc.Mask]

_default_kernel_init = initializers.lecun_normal()
_zeros_init = initializers.zeros_init()


class Attention(nnx.Module):
  """Multi-head attention whose mask is maskc text, run by `maskc.attention`.

  A decoder can use it where it would use `nnx.MultiHeadAttention` (self-attention):
  the projections are the same `nnx.LinearGeneral` layers under the same names
  (`query`, `key`, `value`, `out`), so weights carry over. The mask replaces Flax's
  dense mask argument: it is compiled to tiles, and its runtime operands (segment ids,
  image spans, lengths) are passed at call time.

  Decoding follows Flax's convention: `init_cache(input_shape)` makes the cache, and a
  call with `decode=True` appends its tokens (one, or a prompt) and attends over the
  cache, the mask applied at the cached positions. Layers whose mask provably looks
  back at most `w` tokens (`sliding(w)`, `causal & chunk(w)`, read from the compiled
  mask's band and chunk facts) keep a ring of `w` slots; the others keep every token.

  Args:
    num_heads: query heads.
    in_features: the input's last dimension.
    qkv_features: query features, `num_heads * head_dim` (default `in_features`, or
      `num_heads * head_dim` when `head_dim` is given).
    out_features: the output's last dimension (default `in_features`).
    num_kv_heads: key/value heads (default `num_heads`); fewer is GQA, 1 is MQA.
    head_dim: features per head (default `qkv_features // num_heads`).
    mask: mask text, a `maskc.Mask`, a `maskc.MaskSpec`, or a sequence of texts/Masks,
      one per query head.
    mask_params: values of the mask's parameters (`{"W": 4096}` for `sliding(W)`).
    logits_soft_cap: if set, logits become `cap * tanh(logits / cap)`.
    sinks: learn one sink logit per head (`sink_logits`, joining every softmax
      denominator; initialized by `sinks_init`).
    scale: logit scale (default `1 / sqrt(head_dim)`).
    backend, block_q, block_kv: as in `maskc.attention`.
    cache_window: ring-buffer size for decoding: `"auto"` (the mask's proven lookback,
      else the full cache), None (always the full cache), or an int `w` you vouch for:
      every key a row may attend before the call's first position lies within the last
      `w` positions (say, `sliding(W) | bidirectional(img)` with images shorter than W,
      each prefilled in one call).
    rope: `rope(x, positions) -> x`, applied to q `[B, L, H, D]` and k `[B, L, Hkv, D]`
      with positions `[B, L]` (int32), before attention and before caching.
    decode: the default of `__call__`'s `decode`.
    dtype, param_dtype, precision, use_bias, kernel_init, out_kernel_init, bias_init,
      out_bias_init: as in `nnx.MultiHeadAttention`.
    sinks_init: initializer of `sink_logits` `[num_heads]`.
    rngs: parameter initialization keys.

  Raises:
    MaskValueError: sizes that do not divide, or a per-head mask list of the wrong length.
    MaskError: a mask that does not parse or check (with its caret).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from maskc.flax import Attention
  >>> attn = Attention(4, 32, num_kv_heads=2, mask="sliding(W)", mask_params={"W": 8},
  ...                  rngs=nnx.Rngs(0))
  >>> attn(jnp.ones((2, 16, 32))).shape
  (2, 16, 32)
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None, *,
               head_dim: int | None = None, mask: MaskArg = "causal",
               mask_params: Mapping[str, Any] | None = None,
               logits_soft_cap: float | None = None, sinks: bool = False,
               scale: float | None = None, backend: str = "auto", block_q: int | None = None,
               block_kv: int | None = None,
               cache_window: int | Literal["auto"] | None = "auto",
               rope: Rope | None = None, decode: bool = False,
               dtype: Any = None, param_dtype: Any = jnp.float32, precision: Any = None,
               use_bias: bool = True, kernel_init: Initializer = _default_kernel_init,
               out_kernel_init: Initializer | None = None,
               bias_init: Initializer = _zeros_init,
               out_bias_init: Initializer | None = None,
               sinks_init: Initializer = _zeros_init,
               rngs: nnx.Rngs) -> None:
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("in_features", in_features)):
      if not isinstance(value, int) or value < 1:
        raise maskc.MaskValueError(f"{name} must be a positive int, got {name}={value!r}")
    if num_heads % num_kv_heads:
      raise maskc.MaskValueError(
          f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}",
          hint="Each key/value head serves num_heads // num_kv_heads query heads (GQA).")
    if head_dim is None:
      qkv_features = in_features if qkv_features is None else qkv_features
      if qkv_features % num_heads:
        raise maskc.MaskValueError(
            f"qkv_features={qkv_features} does not divide into num_heads={num_heads} heads",
            hint="Pass head_dim, or qkv_features a multiple of num_heads.")
      head_dim = qkv_features // num_heads
    elif qkv_features is not None and qkv_features != num_heads * head_dim:
      raise maskc.MaskValueError(
          f"qkv_features={qkv_features} differs from num_heads * head_dim = "
          f"{num_heads} * {head_dim}", hint="Pass one of qkv_features and head_dim.")
    if cache_window is not None and cache_window != "auto" and (
        not isinstance(cache_window, int) or cache_window < 1):
      raise maskc.MaskValueError(
          f"cache_window must be 'auto', None or a positive int, got {cache_window=}")
    spec = maskc.MaskSpec(mask, mask_params)
    masks = _cache.masks_of(spec)
    if not isinstance(spec.mask, maskc.Mask) and len(masks) != num_heads:
      raise maskc.MaskValueError(
          f"the per-head mask has {len(masks)} entries for num_heads={num_heads}",
          hint="Give one mask per query head, or one mask for all of them.")
    for m in masks:
      for operand in m.operands:
        if operand.name == _cache.CACHE_LEN:
          raise maskc.MaskNameError(
              f"the operand name `{_cache.CACHE_LEN}` is maskc.flax's own",
              hint="Rename the operand.")

    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.in_features = in_features
    self.head_dim = head_dim
    self.qkv_features = num_heads * head_dim
    self.out_features = in_features if out_features is None else out_features
    self.mask = spec
    self.logits_soft_cap = logits_soft_cap
    self.scale = scale
    self.backend = backend
    self.block_q = block_q
    self.block_kv = block_kv
    self.cache_window = cache_window
    self.rope = rope
    self.decode = decode
    self.dtype = dtype

    def dense(features: int | tuple[int, ...], out: int | tuple[int, ...], **kw: Any) -> Any:
      return nnx.LinearGeneral(features, out, dtype=dtype, param_dtype=param_dtype,
                               precision=precision, use_bias=use_bias, rngs=rngs, **kw)

    self.query = dense(in_features, (num_heads, head_dim), kernel_init=kernel_init,
                       bias_init=bias_init)
    self.key = dense(in_features, (num_kv_heads, head_dim), kernel_init=kernel_init,
                     bias_init=bias_init)
    self.value = dense(in_features, (num_kv_heads, head_dim), kernel_init=kernel_init,
                       bias_init=bias_init)
    self.out = dense((num_heads, head_dim), self.out_features, axis=(-2, -1),
                     kernel_init=out_kernel_init or kernel_init,
                     bias_init=out_bias_init or bias_init)
    self.sink_logits: nnx.Param[Array] | None = nnx.data(
        nnx.Param(sinks_init(rngs.params(), (num_heads,), param_dtype)) if sinks else None)
    self.cached_key: nnx.Cache[Array] | None = nnx.data(None)
    self.cached_value: nnx.Cache[Array] | None = nnx.data(None)
    self.cache_index: nnx.Cache[Array] | None = nnx.data(None)
    self.cached_operands: dict[str, nnx.Cache[Array]] = nnx.data({})
    self.cache_length = 0

  # ------------------------------------------------------------------ the mask

  @property
  def masks(self) -> tuple[maskc.Mask, ...]:
    """The layer's masks: one, or one per query head."""
    return _cache.masks_of(self.mask)

  def _mask_arg(self, masks: Sequence[maskc.Mask]) -> maskc.MaskLike:
    return masks[0] if isinstance(self.mask.mask, maskc.Mask) else list(masks)

  @property
  def window(self) -> int | None:
    """The ring-buffer size a decode cache uses (None: it keeps every token)."""
    if self.cache_window == "auto":
      return _cache.window_of(self.masks)
    return self.cache_window

  # ------------------------------------------------------------------ calls

  def __call__(self, x: Array, *, operands: Mapping[str, Any] | None = None,
               positions: Array | None = None, decode: bool | None = None) -> Array:
    """Self-attention over `x` `[B, L, in_features]`; returns `[B, L, out_features]`.

    Args:
      x: the input tokens.
      operands: the mask's runtime operands. Without `decode`, values for the whole
        sequence, as `maskc.attention` takes them. With `decode`, per-token operands
        are the values of this call's tokens (`[B, L]` or `[L]`), written into the
        cache at their positions; a per-token operand left out takes False when the
        mask reads it as a boolean (generated tokens are text, outside image spans)
        and the previous token's value otherwise (they stay in the current
        document); a scalar operand left out keeps the value given last.
      positions: token positions `[L]` or `[B, L]` (default `0..L-1`), for the rotary
        hook and as the mask's query and key positions. With `decode` the cache
        supplies them (`cache_index + 0..L-1`), and passing them is an error.
      decode: append to the cache and attend over it (default: the module's `decode`).

    Raises:
      MaskValueError: a wrong input shape; `decode` without `init_cache`, or with
        positions; more tokens than the cache holds.
      OperandError: an operand the mask does not read, or of the wrong shape.
    """
    if x.ndim != 3 or x.shape[-1] != self.in_features:
      raise maskc.MaskValueError(
          f"x has shape {tuple(x.shape)}; the module takes [B, L, {self.in_features}]")
    q, k, v = self.query(x), self.key(x), self.value(x)
    if self.decode if decode is None else decode:
      if positions is not None:
        raise maskc.MaskValueError(
            "positions were given with decode=True, but the cache supplies them",
            hint="Leave positions out: a decode call's tokens sit at cache_index + 0..L-1.")
      out = self._decode(q, k, v, operands)
    else:
      if self.rope is not None:
        pos = jnp.arange(x.shape[1], dtype=jnp.int32) if positions is None else positions
        pos = jnp.broadcast_to(jnp.asarray(pos, jnp.int32), x.shape[:2])
        q, k = self.rope(q, pos), self.rope(k, pos)
      out = maskc.attention(q, k, v, self._mask_arg(self.masks), operands=operands,
                            q_positions=positions, kv_positions=positions,
                            block_q=self.block_q, block_kv=self.block_kv,
                            **self._attention_kw())
    result: Array = self.out(out)
    return result

  def _attention_kw(self) -> dict[str, Any]:
    sinks = None if self.sink_logits is None else self.sink_logits[...]
    return dict(backend=self.backend, scale=self.scale, logits_soft_cap=self.logits_soft_cap,
                sinks=sinks)

  # ------------------------------------------------------------------ decoding

  def init_cache(self, input_shape: Sequence[int], dtype: Any = jnp.float32) -> None:
    """Creates an empty KV cache for inputs of `input_shape` `[B, max_length, features]`.

    Keys and values are `[B, S, num_kv_heads, head_dim]` in `dtype`, with `S` the ring
    size (`self.window`) or `max_length`; `cache_index` counts the tokens written. Each
    per-token operand the mask reads is kept at every position (`[B, max_length + 1]`:
    a few bytes a token, the last entry a never-attended pad), so documents and image
    spans of the prompt stay in force while decoding.

    Raises:
      MaskValueError: a shape that is not `[B, max_length, features]`.
      OperandError: the mask reads a pairwise operand, which no cache can extend.
    """
    if len(input_shape) != 3:
      raise maskc.MaskValueError(
          f"input_shape={tuple(input_shape)}: the cache takes [B, max_length, features]")
    batch, length = int(input_shape[0]), int(input_shape[1])
    window = self.window
    size = length if window is None else min(window, length)
    shape = (batch, size, self.num_kv_heads, self.head_dim)
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
    self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))
    self.cache_length = length
    cached: dict[str, nnx.Cache[Array]] = {}
    for spec in self.mask.operands:
      if spec.kind == "token":
        dt = jnp.bool_ if spec.boolean else jnp.int32
        cached[spec.name] = nnx.Cache(jnp.zeros((batch, length + 1), dt))
      elif spec.kind == "scalar":
        cached[spec.name] = nnx.Cache(jnp.zeros((batch,), jnp.int32))
      else:
        raise maskc.OperandError(
            f"the mask reads the pairwise operand `{spec.name}`, which a KV cache cannot "
            f"extend token by token",
            hint="Decode with a mask of per-token and scalar operands, or run the whole "
                 "sequence without decode.")
    self.cached_operands = nnx.data(cached)

  def _decode(self, q: Array, k: Array, v: Array,
              operands: Mapping[str, Any] | None) -> Array:
    if self.cached_key is None or self.cached_value is None or self.cache_index is None:
      raise maskc.MaskValueError("decode=True needs a cache",
                                 hint="Call init_cache((batch, max_length, features)) first.")
    batch, n = q.shape[:2]
    cached_k, cached_v = self.cached_key[...], self.cached_value[...]
    if cached_k.shape[0] != batch:
      raise maskc.MaskValueError(
          f"the cache holds a batch of {cached_k.shape[0]}, the call has {batch}",
          hint="Call init_cache with this batch size.")
    if n > self.cache_length:
      raise maskc.MaskValueError(
          f"{n} tokens do not fit in a cache of max_length={self.cache_length}")
    index = self.cache_index[...]
    end = index + n
    pos = index + jnp.arange(n, dtype=jnp.int32)
    if self.rope is not None:
      pos_b = jnp.broadcast_to(pos, (batch, n))
      q, k = self.rope(q, pos_b), self.rope(k, pos_b)
    k, v = k.astype(cached_k.dtype), v.astype(cached_v.dtype)
    ops = self._append_operands(operands, index, batch, n)
    ops[_cache.CACHE_LEN] = end
    masks = self._mask_arg(_cache.with_cache_bound(self.masks))
    # One decode row should not pay for a prefill tile of queries.
    block_q = None if self.block_q is None and n >= 8 else min(self.block_q or n, n)
    kw = dict(operands=ops, block_q=block_q, block_kv=self.block_kv, **self._attention_kw())
    size = cached_k.shape[1]
    if self.window is None:
      start = (0, index, 0, 0)
      keys = jax.lax.dynamic_update_slice(cached_k, k, start)
      values = jax.lax.dynamic_update_slice(cached_v, v, start)
      # A traced offset, which maskc.attention compiles inside the trace (its signature
      # says int); an offset rather than positions keeps the map's band for cuDNN.
      out = maskc.attention(q, keys, values, masks, q_offset=cast(int, index), **kw)
    else:
      # The ring holds positions index - size .. index - 1; this call's keys join it, so a
      # prompt longer than the ring still sees every key of its own rows.
      ring = _cache.ring_positions(index, size, sentinel=self.cache_length)
      out = maskc.attention(q, jnp.concatenate([cached_k, k], axis=1),
                            jnp.concatenate([cached_v, v], axis=1), masks,
                            q_positions=pos, kv_positions=jnp.concatenate([ring, pos]), **kw)
      kept = min(n, size)
      slots = _cache.ring_slots(end, kept, size)
      keys = cached_k.at[:, slots].set(k[:, n - kept:])
      values = cached_v.at[:, slots].set(v[:, n - kept:])
    self.cached_key[...] = keys
    self.cached_value[...] = values
    self.cache_index[...] = end
    return out

  def _append_operands(self, operands: Mapping[str, Any] | None, index: Array, batch: int,
                       n: int) -> dict[str, Array]:
    """Writes this call's operand values into the cache; returns every cached array."""
    given = dict(operands or {})
    reads = {s.name: s for s in self.mask.operands}
    unknown = sorted(set(given) - set(reads))
    if unknown:
      raise maskc.OperandError(
          f"the mask reads no operand {', '.join(f'`{u}`' for u in unknown)}",
          hint=f"It reads: {', '.join(sorted(reads)) or 'none'}.")
    out: dict[str, Array] = {}
    for name, spec in reads.items():
      cache = self.cached_operands[name]
      old = cache[...]
      if spec.kind == "scalar":
        new = old if name not in given else jnp.broadcast_to(
            jnp.asarray(given[name], jnp.int32), (batch,))
      else:
        if name in given:
          value = jnp.asarray(given[name])
          if value.shape not in ((n,), (batch, n)):
            raise maskc.OperandError(
                f"operand `{name}` has shape {tuple(value.shape)}; with decode=True it holds "
                f"this call's {n} tokens: [{n}] or [{batch}, {n}]")
          value = jnp.broadcast_to(value, (batch, n)).astype(old.dtype)
        elif spec.boolean:
          value = jnp.zeros((batch, n), old.dtype)
        else:
          before = jnp.take(old, jnp.maximum(index - 1, 0), axis=1)
          value = jnp.broadcast_to(before[:, None], (batch, n))
        new = jax.lax.dynamic_update_slice(old, value, (0, index))
      cache[...] = new
      out[name] = new
    return out
