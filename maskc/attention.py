"""`maskc.attention` and `maskc.sharded_attention`: compile a mask and run it on a backend.

The kernels (`maskc.kernels`, which load Pallas) are imported by these functions when
they are first called, so `import maskc` loads none: this is the one place the
compiler's public face reaches the kernels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from maskc.compiled.blockmap import BlockMap
from maskc.language.errors import BackendError, MaskValueError
from maskc.language.ir import Mask
from maskc.lowering.compile import bind_map, compile
from maskc.parallel import layout as _layout, sharding as _sharding
from maskc.parallel.layout import Layout, balance

MaskLike = str | Mask | Sequence[str | Mask]
"""A mask as text or IR, or one per query head."""


def attention(q: jax.typing.ArrayLike, k: jax.typing.ArrayLike, v: jax.typing.ArrayLike,
              mask: MaskLike | BlockMap, *,
              operands: Mapping[str, jax.typing.ArrayLike] | None = None,
              backend: str = "auto", block_q: int | None = None, block_kv: int | None = None,
              scale: float | None = None, logits_soft_cap: float | None = None,
              sinks: jax.typing.ArrayLike | None = None, q_offset: int | None = None,
              interpret: bool | None = None, q_positions: jax.typing.ArrayLike | None = None,
              kv_positions: jax.typing.ArrayLike | None = None,
              contiguous: Sequence[str] = ()) -> jax.Array:
  """Masked multi-head attention: compiles `mask` and runs it on an attention backend.

  Works under `jit`, `grad` and `vmap`. Static masks compile once (`maskc.compile`
  caches them); masks with traced operands compile inside the trace. The kernel
  code (`maskc.kernels`) is imported on first call, so `import maskc` loads none.

  Args:
    q: `[B, Lq, H, D]`. k, v: `[B, Lkv, Hkv, D]` / `[B, Lkv, Hkv, Dv]` with
      `H % Hkv == 0` (GQA; `Hkv = 1` is MQA).
    mask: mask text, a `Mask`, a sequence of them (one per query head), or a
      compiled `BlockMap` (whose tiles, offset and operands are then used).
    operands: values of the runtime operands the mask reads (NumPy or jax arrays).
    backend: `"auto"` (see `maskc.kernels.api.choose`: splash on TPU; cudnn, tokamax
      or flash on GPU by a cost model on the compiled map; xla on CPU, dense when the
      mask is tiny or nearly full), or one of `maskc.kernels.BACKENDS`: `dense`, `xla`,
      `flash`, `splash` (tokamax's splash kernel where tokamax imports, else JAX's),
      `splash_tokamax`, `splash_jax`, `cudnn`, `tokamax` (tokamax's Mosaic GPU kernel).
    block_q, block_kv: tile sizes (default: the backend's).
    scale: logit scale (default `1 / sqrt(D)`).
    logits_soft_cap: if set, logits become `cap * tanh(logits / cap)`.
    sinks: optional float `[H]` learned sink logits joining each softmax denominator.
    q_offset: position of query row 0 (default `Lkv - Lq`, bottom-right aligned).
    interpret: run Pallas kernels in interpret mode (default: when not on their
      native platform).
    q_positions, kv_positions: the mask position of each query row / key column,
      `[L]` or `[B, L]` (NumPy or traced), instead of `q_offset + i` and `j`: for
      sequences stored out of order (zigzag or striped context-parallel layouts).
    contiguous: operands whose every id is one run of each batch row (packed
      documents), as `maskc.compile` takes them: under `jit` it lets `auto` run
      `causal & document(seg)` on an engine that reads key intervals (tokamax).

  Returns:
    `[B, Lq, H, Dv]` in q's dtype. Rows with no allowed key are zero, with zero
    gradients.

  Raises:
    BackendError: the backend cannot run this mask; the message names one that can.
    MaskValueError: shapes, lengths, operands or block sizes do not fit.

  >>> import jax.numpy as jnp
  >>> x = jnp.ones((1, 256, 2, 16))
  >>> attention(x, x, x, "sliding(64)", backend="xla").shape
  (1, 256, 2, 16)
  """
  from maskc.kernels import api, common as _common

  kw: dict[str, Any] = dict(scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
                            interpret=interpret)
  if isinstance(mask, BlockMap):
    if operands:
      raise MaskValueError("operands were given with a compiled BlockMap, which holds its own",
                           hint="Pass the operands to maskc.compile instead.")
    if q_positions is not None or kv_positions is not None:
      raise MaskValueError("positions were given with a compiled BlockMap, which holds its own",
                           hint="Pass q_positions/kv_positions to maskc.compile instead.")
    if q_offset is not None and mask.is_static and int(q_offset) != int(mask.q_offset):
      raise MaskValueError(f"q_offset={q_offset} differs from the BlockMap's "
                           f"q_offset={mask.q_offset}")
    for arg, value, have in (("block_q", block_q, mask.block_q),
                             ("block_kv", block_kv, mask.block_kv)):
      if value is not None and value != have:
        raise MaskValueError(f"{arg}={value} differs from the BlockMap's {arg}={have}",
                             hint="Compile the mask with the tile sizes you want.")
    return api.attention(q, k, v, mask, backend=backend, **kw)
  _, lq, _, lkv, _, _ = _common.check_qkv(q, k, v)
  name = api.choose_backend(backend, lq, lkv)
  if not api.BACKENDS[name].reads_tiles:
    bm = bind_map(mask, lq, lkv, q_offset=q_offset, operands=operands,
                   q_positions=q_positions, kv_positions=kv_positions)
    return api.attention(q, k, v, bm, backend=name, **kw)
  bq, bk = api.default_blocks(name, lq, lkv)
  bm = compile(mask, lq, lkv, block_q=block_q or bq, block_kv=block_kv or bk,
               q_offset=q_offset, operands=operands, q_positions=q_positions,
               kv_positions=kv_positions, contiguous=contiguous)
  return api.attention(q, k, v, bm, backend=backend, **kw)


def sharded_attention(q: jax.typing.ArrayLike, k: jax.typing.ArrayLike,
                      v: jax.typing.ArrayLike, mask: MaskLike, *, mesh: jax.sharding.Mesh,
                      batch_axis: str | None = None, head_axis: str | None = None,
                      seq_axis: str | None = None, strategy: str = "all_gather",
                      layout: str | Layout = "contiguous",
                      operands: Mapping[str, jax.typing.ArrayLike] | None = None,
                      backend: str = "auto",
                      inputs_permuted: bool = False, block_q: int | None = None,
                      block_kv: int | None = None, scale: float | None = None,
                      logits_soft_cap: float | None = None,
                      sinks: jax.typing.ArrayLike | None = None,
                      interpret: bool | None = None) -> jax.Array:
  """Masked attention sharded over a `jax.sharding.Mesh` with `jax.shard_map`.

  Batch goes over `batch_axis`, heads and KV heads over `head_axis`, the sequence
  over `seq_axis` (context parallelism), each None to leave that dimension whole.
  The sequence is laid out by `layout` (`maskc.balance`): each shard's queries
  attend with the block map compiled for its own rows (at the layout's positions),
  so the mask can be any mask. Static (NumPy) operands are read once, outside the
  devices; traced ones (a call inside `jax.jit` with operands as arguments), and global
  arrays spanning several processes, are handed to the devices, each compiling its
  shard's map from the values it holds. Arrays may arrive in any sharding (host,
  replicated, sharded along any axis, on a mesh with `Auto` or `Explicit` axes): each
  is resharded to what the devices need (docs/sharding.md).

  Args:
    q, k, v: global `[B, L, H, D]` / `[B, L, Hkv, D]` arrays (self-attention: q and
      k have the same length), in natural token order unless `inputs_permuted`.
    mask: mask text or a Mask (one for every head), or a sequence of them, one per
      query head; with `head_axis`, each head shard attends with its heads' masks.
    mesh: the device mesh; the named axes must divide B, H and Hkv, and L into
      whole tiles per shard.
    strategy: `"all_gather"` (K/V gathered over `seq_axis`) or `"ring"` (K/V passed
      around the ring with `ppermute`, one block map per (q shard, kv shard) step,
      empty steps skipped, partial softmaxes combined exactly by their log-sum-exp
      from the backend's `run_with_lse`).
    layout: `"contiguous"`, `"zigzag"`, `"balanced"` or a `maskc.Layout` for `L`
      tokens over the `seq_axis` shards. `"balanced"` reads the operands: with traced
      ones, balance outside jit on representative values and pass the Layout.
    operands: operand values at natural positions (NumPy, jax arrays in any sharding,
      or traced); batched ones are split over `batch_axis`.
    backend: the per-shard attention backend: `"auto"` (as in `maskc.attention`;
      ring steps never run dense, which has no log-sum-exp), `"xla"`, `"flash"`,
      `"splash"` (interpret mode off their platforms), or `"dense"` (all_gather).
    inputs_permuted: q, k, v are already in the layout's stored order (permuted once
      in the input pipeline, as MaxText does); the output is then in that order too.
    block_q, block_kv: tile sizes (default: the backend's, cut to divide the chunks).
    scale, logits_soft_cap, sinks, interpret: as in `maskc.attention`.

  Returns:
    `[B, L, H, Dv]` in the order of the inputs.

  Raises:
    MaskValueError: axes that do not divide the arrays, or a layout that does not fit.
    BackendError: a backend the strategy cannot run on.
  """
  from maskc.kernels import (  # kernels stay lazy: `import maskc` needs none
    api,
    common as _common,
    sharded,
  )

  b, lq, h, lkv, hkv, _ = _common.check_qkv(q, k, v)
  if lq != lkv:
    raise MaskValueError(f"sharded attention is self-attention: q has {lq} tokens, k {lkv}",
                         hint="Give q, k and v the same sequence length.")
  sizes = {}
  for name, axis, dims in (("batch_axis", batch_axis, [("batch", b)]),
                           ("head_axis", head_axis, [("heads", h), ("kv heads", hkv)]),
                           ("seq_axis", seq_axis, [])):
    if axis is None:
      sizes[name] = 1
      continue
    if axis not in mesh.shape:
      raise MaskValueError(f"{name}={axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    sizes[name] = int(mesh.shape[axis])
    for what, n in dims:
      if n % sizes[name]:
        raise MaskValueError(f"{what} = {n} does not divide over {sizes[name]} devices of "
                             f"mesh axis {axis!r}")
  shards = sizes["seq_axis"]
  name = api.choose_backend(backend, lq // shards, lkv, need_lse=strategy == "ring")
  if strategy == "ring" and api.BACKENDS[name].load().run_with_lse is None:
    raise BackendError(f"the ring strategy combines its steps by their log-sum-exp, which "
                       f"the {name} backend does not return (it has no run_with_lse)",
                       hint="Use backend='xla', 'flash' or 'splash', or "
                            "strategy='all_gather'.")
  groups = _sharding.head_groups(mask, h, sizes["head_axis"])
  masks = [m for gs in groups for m, _ in gs]
  if isinstance(layout, Layout):
    if layout.seq_len != lq or layout.shards != shards:
      raise MaskValueError(f"the layout is for {layout.seq_len} tokens over {layout.shards} "
                           f"shards; the call has {lq} tokens over {shards}")
    chunk = layout.chunk
  else:
    chunk = lq // (2 * shards) if layout == "zigzag" else lq // shards
  if not api.BACKENDS[name].reads_tiles:
    bq = bk = chunk
  else:
    dq, dk = api.default_blocks(name, max(1, lq // shards), lkv)
    bq, bk = block_q or math.gcd(dq, chunk), block_kv or math.gcd(dk, chunk)
    lanes = api.BACKENDS[name].block_kv_multiple
    if bk % lanes:
      raise MaskValueError(
          f"{name} needs key tiles of {lanes} tokens, but the layout's chunks of {chunk} "
          f"tokens allow tiles of {bk}",
          hint=f"Use a sequence length whose per-shard chunks are multiples of {lanes} (here "
               f"L a multiple of {lanes * lq // chunk}), or backend='xla' or 'flash'.")
  traced = _layout.on_devices(operands)
  if not isinstance(layout, Layout):
    if traced:
      layout = _layout.fixed_layout(lq, shards, block=math.lcm(bq, bk), method=layout)
    else:
      layout = balance(mask, lq, shards, block=math.lcm(bq, bk), operands=operands,
                       method=layout)
  kinds = _sharding.operand_kinds(masks)
  batched = any(_sharding.is_batched(kinds, n, x) for n, x in (operands or {}).items())
  plan = _sharding.plan(mask, layout, strategy=strategy, block_q=bq, block_kv=bk,
                        operands=operands, batch=b,
                        data_shards=sizes["batch_axis"] if batched else 1, heads=h,
                        head_shards=sizes["head_axis"])
  if not inputs_permuted:
    q, k, v = (layout.permute(x, axis=1) for x in (q, k, v))
  out: jax.Array = sharded.run(q, k, v, plan, mesh=mesh, batch_axis=batch_axis,
                               head_axis=head_axis, seq_axis=seq_axis, backend=name,
                               sinks=sinks, scale=scale, logits_soft_cap=logits_soft_cap,
                               interpret=interpret, operands=operands if traced else None,
                               operand_kinds=kinds)
  if inputs_permuted:
    return out
  return layout.unpermute(out, axis=1)
