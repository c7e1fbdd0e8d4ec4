"""`maskc.flax.Attention`: multi-head attention as an NNX module, its mask compiled by maskc."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
import numpy as np
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

  A model can use it where it would use `nnx.MultiHeadAttention`, for self-attention or
  cross-attention: the projections are the same `nnx.LinearGeneral` layers under the same
  names (`query`, `key`, `value`, `out`, and `query_ln`, `key_ln` with `normalize_qk`),
  so weights carry over. The mask replaces Flax's dense mask argument: it is compiled to
  tiles, and its runtime operands (segment ids, image spans, lengths) are passed at call
  time.

  Decoding follows Flax's convention: `init_cache(input_shape)` makes the cache, and a
  call with `decode=True` appends its tokens (one, or a prompt) and attends over the
  cache, the mask applied at the cached positions. Layers whose mask provably looks
  back at most `w` tokens (`sliding(w)`, `causal & chunk(w)`, read from the compiled
  mask's band and chunk facts) keep a ring of `w` slots; the others keep every token.
  `init_cache(..., ragged=True)` keeps one index per batch row, for prompts of different
  lengths (a decode call then takes `lengths`).

  Dropout on the attention weights and `sow_weights` need the weights themselves, which
  maskc's kernels never form: those calls compute attention densely (the mask
  materialized, `O(Lq * Lkv)` memory), so dropout needs `backend="dense"`.

  Args:
    num_heads: query heads.
    in_features: the query input's last dimension.
    in_kv_features: the key/value inputs' last dimension (default `in_features`).
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
    dropout_rate, broadcast_dropout, deterministic, keep_rngs: dropout on the attention
      weights, as in `nnx.MultiHeadAttention` (a nonzero rate needs `backend="dense"`).
    normalize_qk: normalize q and k per head after the projections: True (or `"layer"`)
      is Flax's LayerNorm without bias (`query_ln`, `key_ln`), `"rms"` an `nnx.RMSNorm`
      under the same names.
    dtype, param_dtype, precision, use_bias, kernel_init, out_kernel_init, bias_init,
      out_bias_init: as in `nnx.MultiHeadAttention`.
    sinks_init: initializer of `sink_logits` `[num_heads]`.
    rngs: parameter initialization keys.

  Raises:
    MaskValueError: sizes that do not divide, a per-head mask list of the wrong length, a
      dropout rate outside [0, 1).
    BackendError: a nonzero dropout rate with a backend other than `"dense"`.
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
               in_kv_features: int | None = None,
               head_dim: int | None = None, mask: MaskArg = "causal",
               mask_params: Mapping[str, Any] | None = None,
               logits_soft_cap: float | None = None, sinks: bool = False,
               scale: float | None = None, backend: str = "auto", block_q: int | None = None,
               block_kv: int | None = None,
               cache_window: int | Literal["auto"] | None = "auto",
               rope: Rope | None = None, decode: bool = False,
               dropout_rate: float = 0.0, broadcast_dropout: bool = True,
               deterministic: bool | None = None,
               normalize_qk: bool | Literal["layer", "rms"] = False,
               dtype: Any = None, param_dtype: Any = jnp.float32, precision: Any = None,
               use_bias: bool = True, kernel_init: Initializer = _default_kernel_init,
               out_kernel_init: Initializer | None = None,
               bias_init: Initializer = _zeros_init,
               out_bias_init: Initializer | None = None,
               sinks_init: Initializer = _zeros_init,
               rngs: nnx.Rngs, keep_rngs: bool = True) -> None:
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    in_kv_features = in_features if in_kv_features is None else in_kv_features
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("in_features", in_features), ("in_kv_features", in_kv_features)):
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
    if not 0.0 <= dropout_rate < 1.0:
      raise maskc.MaskValueError(f"dropout_rate must lie in [0, 1), got {dropout_rate}")
    if dropout_rate > 0.0 and backend != "dense":
      raise maskc.BackendError(
          f"dropout_rate={dropout_rate} with backend={backend!r}: dropout acts on the "
          f"attention weights, which only the dense path forms",
          hint="Pass backend='dense' (attention computed densely, O(Lq * Lkv) memory), or "
               "dropout_rate=0.")
    if normalize_qk not in (False, True, "layer", "rms"):
      raise maskc.MaskValueError(
          f"normalize_qk must be False, True, 'layer' or 'rms', got {normalize_qk!r}")
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
    self.in_kv_features = in_kv_features
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
    self.dropout_rate = dropout_rate
    self.broadcast_dropout = broadcast_dropout
    self.deterministic = deterministic
    self.normalize_qk = normalize_qk
    self.dtype = dtype

    def dense(features: int | tuple[int, ...], out: int | tuple[int, ...], **kw: Any) -> Any:
      return nnx.LinearGeneral(features, out, dtype=dtype, param_dtype=param_dtype,
                               precision=precision, use_bias=use_bias, rngs=rngs, **kw)

    self.query = dense(in_features, (num_heads, head_dim), kernel_init=kernel_init,
                       bias_init=bias_init)
    self.key = dense(in_kv_features, (num_kv_heads, head_dim), kernel_init=kernel_init,
                     bias_init=bias_init)
    self.value = dense(in_kv_features, (num_kv_heads, head_dim), kernel_init=kernel_init,
                       bias_init=bias_init)
    self.query_ln: nnx.LayerNorm | nnx.RMSNorm | None = nnx.data(None)
    self.key_ln: nnx.LayerNorm | nnx.RMSNorm | None = nnx.data(None)
    if normalize_qk:
      def norm() -> nnx.LayerNorm | nnx.RMSNorm:
        if normalize_qk == "rms":
          return nnx.RMSNorm(head_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        return nnx.LayerNorm(head_dim, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                             rngs=rngs)
      self.query_ln, self.key_ln = norm(), norm()
    self.out = dense((num_heads, head_dim), self.out_features, axis=(-2, -1),
                     kernel_init=out_kernel_init or kernel_init,
                     bias_init=out_bias_init or bias_init)
    self.sink_logits: nnx.Param[Array] | None = nnx.data(
        nnx.Param(sinks_init(rngs.params(), (num_heads,), param_dtype)) if sinks else None)
    self.rngs: nnx.RngStream | None = nnx.data(
        rngs.dropout.fork() if keep_rngs and dropout_rate > 0 else None)
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

  def __call__(self, inputs_q: Array, inputs_k: Array | None = None,
               inputs_v: Array | None = None, *, operands: Mapping[str, Any] | None = None,
               positions: Array | None = None, kv_positions: Array | None = None,
               lengths: Array | None = None, decode: bool | None = None,
               deterministic: bool | None = None,
               rngs: nnx.Rngs | nnx.RngStream | None = None,
               sow_weights: bool = False) -> Array:
    """Attention of `inputs_q` `[B, Lq, in_features]` over `inputs_k` / `inputs_v`
    `[B, Lkv, in_kv_features]`; returns `[B, Lq, out_features]`.

    Self-attention when `inputs_k` and `inputs_v` are left out; `inputs_v` left out
    takes `inputs_k` (as in `nnx.MultiHeadAttention`).

    Args:
      inputs_q: the query tokens.
      inputs_k, inputs_v: the key and value tokens, for cross-attention.
      operands: the mask's runtime operands. Without `decode`, values for the whole
        sequence, as `maskc.attention` takes them (in cross-attention a per-token
        operand is indexed by query and by key positions alike). With `decode`,
        per-token operands are the values of this call's tokens (`[B, L]` or `[L]`),
        written into the cache at their positions; a per-token operand left out takes
        False when the mask reads it as a boolean (generated tokens are text, outside
        image spans) and the previous token's value otherwise (they stay in the current
        document); a scalar operand left out keeps the value given last.
      positions: query positions `[Lq]` or `[B, Lq]` (default `0..Lq-1`), for the rotary
        hook and the mask; in self-attention also the key positions (for sequences
        stored out of order). With `decode` the cache supplies them, and passing them
        is an error.
      kv_positions: key positions `[Lkv]` or `[B, Lkv]` in cross-attention (default
        `0..Lkv-1`).
      lengths: with `decode` and a ragged cache (`init_cache(..., ragged=True)`), the
        real tokens of each row in this call, `[B]` (default: all `L`); the rest of
        the row is padding, neither cached nor attended. A row given 0 stays put.
        Traced lengths outside `0..L` are clipped to it.
      decode: append to the cache and attend over it (default: the module's `decode`).
        Self-attention only.
      deterministic: no dropout (default: the module's `deterministic`); needed when
        `dropout_rate > 0`.
      rngs: the dropout keys (`Rngs`, whose `dropout` stream is used, or a stream);
        default the module's own, kept from construction.
      sow_weights: sow the attention weights `[B, H, Lq, Lkv]` into `nnx.Intermediate`
        as `attention_weights`. The call then runs densely, the mask materialized.

    Raises:
      MaskValueError: a wrong input shape; `decode` without `init_cache`, with
        positions, with cross-attention inputs, or with more tokens than the cache
        holds; `lengths` without a ragged cache; dropout without `deterministic` or
        keys.
      OperandError: an operand the mask does not read, or of the wrong shape.
    """
    if inputs_k is None:
      if inputs_v is not None:
        raise maskc.MaskValueError(
            "inputs_v was given without inputs_k",
            hint="Pass inputs_k (inputs_v defaults to it), as in nnx.MultiHeadAttention.")
      cross = False
      inputs_k = inputs_v = inputs_q
    else:
      cross = True
      inputs_v = inputs_k if inputs_v is None else inputs_v
    self._check_inputs(inputs_q, inputs_k, inputs_v, cross)
    q, k, v = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
    if self.query_ln is not None and self.key_ln is not None:
      q, k = self.query_ln(q), self.key_ln(k)
    dense = self._dense_options(deterministic, rngs, sow_weights)
    if self.decode if decode is None else decode:
      if cross:
        raise maskc.MaskValueError(
            "decode=True with inputs_k: the cache holds self-attention keys, and "
            "cross-attention keys (an encoder's output) do not grow token by token",
            hint="Call without decode, with the encoder's tokens as inputs_k and the "
                 "query tokens' positions as positions.")
      if positions is not None or kv_positions is not None:
        raise maskc.MaskValueError(
            "positions were given with decode=True, but the cache supplies them",
            hint="Leave positions out: a decode call's tokens sit at cache_index + 0..L-1.")
      out = self._decode(q, k, v, operands, lengths, dense)
    else:
      if lengths is not None:
        raise maskc.MaskValueError(
            "lengths were given without decode",
            hint="Outside decoding, mask padding with the mask itself (`& k < n`, `n` a "
                 "scalar operand), or give the rows' positions.")
      if kv_positions is not None and not cross:
        raise maskc.MaskValueError(
            "kv_positions were given for self-attention, whose keys sit at `positions`",
            hint="Pass positions only; kv_positions are for cross-attention (inputs_k).")
      batch, lq, lkv = q.shape[0], q.shape[1], k.shape[1]
      where: dict[str, Any]
      if cross:
        where = dict(kv_positions=kv_positions)
        if positions is None:
          where["q_offset"] = 0
        else:
          where["q_positions"] = positions
      else:
        where = dict(q_positions=positions, kv_positions=positions)
        kv_positions = positions
      if self.rope is not None:
        q = self.rope(q, _row_positions(positions, batch, lq))
        k = self.rope(k, _row_positions(kv_positions, batch, lkv))
      out = self._attend(q, k, v, self._mask_arg(self.masks), operands, where,
                         self.block_q, dense)
    result: Array = self.out(out)
    return result

  def _check_inputs(self, inputs_q: Array, inputs_k: Array, inputs_v: Array,
                    cross: bool) -> None:
    if inputs_q.ndim != 3 or inputs_q.shape[-1] != self.in_features:
      raise maskc.MaskValueError(
          f"inputs_q has shape {tuple(inputs_q.shape)}; the module takes "
          f"[B, L, {self.in_features}]")
    if not cross and self.in_kv_features != self.in_features:
      raise maskc.MaskValueError(
          f"self-attention over inputs of {self.in_features} features, but the key and "
          f"value projections take in_kv_features={self.in_kv_features}",
          hint="Pass inputs_k (cross-attention), or build the module without "
               "in_kv_features.")
    for name, x in (("inputs_k", inputs_k), ("inputs_v", inputs_v)):
      if x.ndim != 3 or x.shape[-1] != self.in_kv_features or x.shape[0] != inputs_q.shape[0]:
        raise maskc.MaskValueError(
            f"{name} has shape {tuple(x.shape)}; the module takes "
            f"[{inputs_q.shape[0]}, Lkv, {self.in_kv_features}]")
    if inputs_k.shape[1] != inputs_v.shape[1]:
      raise maskc.MaskValueError(
          f"inputs_k has {inputs_k.shape[1]} tokens and inputs_v {inputs_v.shape[1]}")

  def _dense_options(self, deterministic: bool | None,
                     rngs: nnx.Rngs | nnx.RngStream | None,
                     sow_weights: bool) -> dict[str, Any] | None:
    """The dense path's dropout key and sowing, or None when the kernels serve the call."""
    dropout_key = None
    if self.dropout_rate > 0.0:
      deterministic = self.deterministic if deterministic is None else deterministic
      if deterministic is None:
        raise maskc.MaskValueError(
            f"dropout_rate={self.dropout_rate} but no `deterministic` was given",
            hint="Pass deterministic=True (inference) or False (training) to the call or "
                 "the module.")
      if not deterministic:
        stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs
        stream = self.rngs if stream is None else stream
        if stream is None:
          raise maskc.MaskValueError(
              "dropout needs keys, and the module kept none (keep_rngs=False)",
              hint="Pass rngs=nnx.Rngs(dropout=...) to the call.")
        dropout_key = stream()
    if dropout_key is None and not sow_weights:
      return None
    return dict(dropout_key=dropout_key, sow=sow_weights)

  def _attention_kw(self) -> dict[str, Any]:
    sinks = None if self.sink_logits is None else self.sink_logits[...]
    return dict(backend=self.backend, scale=self.scale, logits_soft_cap=self.logits_soft_cap,
                sinks=sinks)

  def _attend(self, q: Array, k: Array, v: Array, masks: maskc.MaskLike,
              operands: Mapping[str, Any] | None, where: Mapping[str, Any],
              block_q: int | None, dense: dict[str, Any] | None) -> Array:
    """`maskc.attention`, or the dense path when the call needs the weights."""
    if dense is None:
      return maskc.attention(q, k, v, masks, operands=operands, block_q=block_q,
                             block_kv=self.block_kv, **where, **self._attention_kw())
    return self._dense_attention(q, k, v, masks, operands, where, **dense)

  def _dense_attention(self, q: Array, k: Array, v: Array, masks: maskc.MaskLike,
                       operands: Mapping[str, Any] | None, where: Mapping[str, Any],
                       dropout_key: Array | None, sow: bool) -> Array:
    """Softmax attention over the materialized mask, with Flax's dropout and sowing.

    The weights of a row with no allowed key (and no sink) are zero, as in maskc's
    kernels.
    """
    batch, lq, heads, depth = q.shape
    lkv = k.shape[1]
    allowed = jnp.asarray(maskc.materialize(masks, lq, lkv, operands=operands, **where))
    per_head = not isinstance(self.mask.mask, maskc.Mask)
    if allowed.ndim == 2:
      allowed = allowed[None, None]
    elif allowed.ndim == 3:
      allowed = allowed[None] if per_head else allowed[:, None]
    group = heads // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scale = 1.0 / float(depth) ** 0.5 if self.scale is None else self.scale
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    cap = self.logits_soft_cap
    if cap is not None:
      logits = cap * jnp.tanh(logits / cap)
    masked = jnp.where(allowed, logits, -jnp.inf)
    top = jnp.max(masked, axis=-1, keepdims=True)
    sinks = None if self.sink_logits is None else self.sink_logits[...].astype(jnp.float32)
    if sinks is not None:
      top = jnp.maximum(top, sinks[None, :, None, None])
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    e = jnp.where(allowed, jnp.exp(jnp.where(allowed, logits, top) - top), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
      denom = denom + jnp.exp(sinks[None, :, None, None] - top)
    weights = (e / jnp.where(denom > 0, denom, 1.0)).astype(v.dtype)
    if sow:
      self.sow(nnx.Intermediate, "attention_weights", weights)
    if dropout_key is not None:
      keep_prob = 1.0 - self.dropout_rate
      shape = (1, 1, lq, lkv) if self.broadcast_dropout else weights.shape
      keep = jax.random.bernoulli(dropout_key, keep_prob, shape)
      weights = weights * (keep.astype(weights.dtype) / jnp.asarray(keep_prob, weights.dtype))
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).astype(q.dtype)

  # ------------------------------------------------------------------ decoding

  def init_cache(self, input_shape: Sequence[int], dtype: Any = jnp.float32, *,
                 ragged: bool = False) -> None:
    """Creates an empty KV cache for inputs of `input_shape` `[B, max_length, features]`.

    Keys and values are `[B, S, num_kv_heads, head_dim]` in `dtype`, with `S` the ring
    size (`self.window`) or `max_length`; `cache_index` counts the tokens written. Each
    per-token operand the mask reads is kept at every position (`[B, max_length + 1]`:
    a few bytes a token, the last entry a never-attended pad), so documents and image
    spans of the prompt stay in force while decoding.

    Args:
      input_shape: `[B, max_length, features]`.
      dtype: the cached keys' and values' dtype.
      ragged: keep one index per row (`cache_index` `[B]`), so rows hold different
        numbers of tokens: prompts of different lengths, prefilled right-padded with
        `lengths`, each row then decoding at its own position.

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
    self.cache_index = nnx.Cache(jnp.zeros((batch,) if ragged else (), jnp.int32))
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

  def _decode(self, q: Array, k: Array, v: Array, operands: Mapping[str, Any] | None,
              lengths: Array | None, dense: dict[str, Any] | None) -> Array:
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
    if index.ndim == 1:
      return self._decode_ragged(q, k, v, operands, lengths, dense)
    if lengths is not None:
      raise maskc.MaskValueError(
          "lengths were given, but the cache keeps one index for the whole batch",
          hint="Call init_cache(..., ragged=True) for rows of different lengths.")
    end = index + n
    pos = index + jnp.arange(n, dtype=jnp.int32)
    if self.rope is not None:
      pos_b = jnp.broadcast_to(pos, (batch, n))
      q, k = self.rope(q, pos_b), self.rope(k, pos_b)
    k, v = k.astype(cached_k.dtype), v.astype(cached_v.dtype)
    ops = self._append_operands(operands, index, batch, n)
    ops[_cache.CACHE_LEN] = end
    masks = self._mask_arg(_cache.with_cache_bound(self.masks))
    size = cached_k.shape[1]
    if self.window is None:
      start = (0, index, 0, 0)
      keys = jax.lax.dynamic_update_slice(cached_k, k, start)
      values = jax.lax.dynamic_update_slice(cached_v, v, start)
      # A traced offset, which maskc.attention compiles inside the trace (its signature
      # says int); an offset rather than positions keeps the map's band for cuDNN.
      out = self._attend(q, keys, values, masks, ops, dict(q_offset=cast(int, index)),
                         _decode_block_q(self.block_q, n), dense)
    else:
      # The ring holds positions index - size .. index - 1; this call's keys join it, so a
      # prompt longer than the ring still sees every key of its own rows.
      ring = _cache.ring_positions(index, size, sentinel=self.cache_length)
      out = self._attend(q, jnp.concatenate([cached_k, k], axis=1),
                         jnp.concatenate([cached_v, v], axis=1), masks, ops,
                         dict(q_positions=pos, kv_positions=jnp.concatenate([ring, pos])),
                         _decode_block_q(self.block_q, n), dense)
      kept = min(n, size)
      slots = _cache.ring_slots(end, kept, size)
      keys = cached_k.at[:, slots].set(k[:, n - kept:])
      values = cached_v.at[:, slots].set(v[:, n - kept:])
    self.cached_key[...] = keys
    self.cached_value[...] = values
    self.cache_index[...] = end
    return out

  def _decode_ragged(self, q: Array, k: Array, v: Array,
                     operands: Mapping[str, Any] | None, lengths: Array | None,
                     dense: dict[str, Any] | None) -> Array:
    """A decode call on a per-row cache: row `b` writes its first `lengths[b]` tokens at
    positions `cache_index[b] + 0..`; its padding tokens sit at the cache's end
    position, which the mask's `q, k < maskc_cache_len` bound leaves unattended."""
    assert self.cached_key is not None and self.cached_value is not None
    assert self.cache_index is not None
    batch, n = q.shape[:2]
    cached_k, cached_v = self.cached_key[...], self.cached_value[...]
    index = self.cache_index[...]
    if lengths is None:
      count = jnp.full((batch,), n, jnp.int32)
    else:
      if not isinstance(lengths, jax.core.Tracer):
        static = np.asarray(lengths)
        if static.size and (static.min() < 0 or static.max() > n):
          raise maskc.MaskValueError(
              f"lengths {static.tolist()} are not all in 0..{n}, this call's tokens",
              hint="Give each row's real tokens in this call, the rest being padding.")
      count = jnp.asarray(lengths)
      if count.shape not in ((), (batch,)):
        raise maskc.MaskValueError(
            f"lengths has shape {tuple(count.shape)}; it holds each row's real tokens in "
            f"this call: [{batch}]")
      count = jnp.clip(jnp.broadcast_to(count.astype(jnp.int32), (batch,)), 0, n)
    end = index + count
    steps = jnp.arange(n, dtype=jnp.int32)[None]
    real = steps < count[:, None]
    pos = jnp.where(real, index[:, None] + steps, self.cache_length)  # [B, n]
    if self.rope is not None:
      q, k = self.rope(q, pos), self.rope(k, pos)
    k, v = k.astype(cached_k.dtype), v.astype(cached_v.dtype)
    ops = self._append_operands(operands, index, batch, n, real)
    ops[_cache.CACHE_LEN] = end
    masks = self._mask_arg(_cache.with_cache_bound(self.masks, rows=True))
    size = cached_k.shape[1]
    rows = jnp.arange(batch)[:, None]
    if self.window is None:
      slots = jnp.where(real, pos, size)  # padding goes out of range: not written
      keys = cached_k.at[rows, slots].set(k, mode="drop")
      values = cached_v.at[rows, slots].set(v, mode="drop")
      out = self._attend(q, keys, values, masks, ops, dict(q_positions=pos),
                         _decode_block_q(self.block_q, n), dense)
    else:
      ring = _cache.ring_positions(index, size, sentinel=self.cache_length)  # [B, size]
      out = self._attend(q, jnp.concatenate([cached_k, k], axis=1),
                         jnp.concatenate([cached_v, v], axis=1), masks, ops,
                         dict(q_positions=pos, kv_positions=jnp.concatenate([ring, pos], 1)),
                         _decode_block_q(self.block_q, n), dense)
      slots = _cache.ragged_ring_slots(index, count, n, size)
      keys = cached_k.at[rows, slots].set(k, mode="drop")
      values = cached_v.at[rows, slots].set(v, mode="drop")
    self.cached_key[...] = keys
    self.cached_value[...] = values
    self.cache_index[...] = end
    return out

  def _append_operands(self, operands: Mapping[str, Any] | None, index: Array, batch: int,
                       n: int, real: Array | None = None) -> dict[str, Array]:
    """Writes this call's operand values into the cache; returns every cached array.

    `index` is the cache's index, `[]`, or `[B]` with `real` `[B, n]` marking each row's
    real tokens (padding is not written).
    """
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
        elif real is None:
          before = jnp.take(old, jnp.maximum(index - 1, 0), axis=1)
          value = jnp.broadcast_to(before[:, None], (batch, n))
        else:
          before = jnp.take_along_axis(old, jnp.maximum(index - 1, 0)[:, None], axis=1)
          value = jnp.broadcast_to(before, (batch, n))
        if real is None:
          new = jax.lax.dynamic_update_slice(old, value, (0, index))
        else:
          cols = jnp.where(real, index[:, None] + jnp.arange(n, dtype=jnp.int32),
                           old.shape[1])
          new = old.at[jnp.arange(batch)[:, None], cols].set(value, mode="drop")
      cache[...] = new
      out[name] = new
    return out


def _row_positions(positions: Array | None, batch: int, length: int) -> Array:
  """Positions `[B, L]` (int32) for the rotary hook: the given ones, or `0..L-1`."""
  pos = jnp.arange(length, dtype=jnp.int32) if positions is None else positions
  return jnp.broadcast_to(jnp.asarray(pos, jnp.int32), (batch, length))


def _decode_block_q(block_q: int | None, n: int) -> int | None:
  """One decode row should not pay for a prefill tile of queries."""
  return None if block_q is None and n >= 8 else min(block_q or n, n)
