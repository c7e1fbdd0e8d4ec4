"""Closed forms of the lowering: faster ways to the tiles the generic range analysis
would give, each taken where its precondition holds (`maskc.lowering.rules` names them).
"""
