"""The compiled contract that kernels read: the BlockMap, its tiles and runs, the
compiled predicate, splash's MaskInfo, and views of a map (text, SVG, plots).
"""
