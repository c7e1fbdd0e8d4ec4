"""Closed forms of the lowering, one module a rule: faster ways to the tiles the generic range
analysis would give, each taken where its precondition holds. Each module owns its
`maskc.lowering.rules.Rule` (its match, its static and traced lowers, what `maskc.explain`
says when it does not apply); `maskc.lowering.registry` lists them all.
"""
