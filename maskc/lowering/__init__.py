"""Lowering a bound mask to a BlockMap: the static (NumPy) and traced (`jax.jit`) paths, their
shared grid (`grid/`), the generic mechanism (`generic/`: the dispatch, the range analysis,
the combiner), and the closed forms (`closed_forms/`), one module a rule, listed in
`maskc.lowering.registry` and switched by `maskc.lowering.rules`.
"""
