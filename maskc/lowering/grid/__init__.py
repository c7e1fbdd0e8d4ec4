"""The tile grid the lowering works on, shared by its paths and closed forms: the tiles'
geometry, lists of runs along tile lines, and deciding tiles within a memory budget.
"""
