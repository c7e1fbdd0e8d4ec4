"""Block-sparse attention in Pallas Mosaic GPU for Hopper (`backend="mosaic_gpu"`; not yet
run on a GPU).

`forward` is the backend (its forward kernel and entry points; `forward.BACKWARD` picks the
backward pass), `backward` its opt-in dq and dk/dv kernels, `tiles` the tile code both
share.
"""
