"""Pallas block-sparse flash attention (`backend="flash"`): the kernel and flash-decoding.

`kernel` is the backend (`run`, `run_with_lse`, the forward and backward kernels, walking
each q tile's FULL then PARTIAL key tiles; Triton on a GPU, interpret mode elsewhere);
`decode` splits a decode step's key tiles over several programs and merges their shares
by log-sum-exp.
"""
