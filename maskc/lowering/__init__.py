"""Lowering a bound mask to a BlockMap: the static (NumPy) and traced (`jax.jit`) paths,
their shared geometry and memory budget, and the closed forms (`closed_forms/`), each a
named rule (`maskc.lowering.rules`).
"""
