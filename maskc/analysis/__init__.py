"""Facts proved from a mask's IR alone: linear forms and exact bands of `q - k`, the
diagonal period, and truth on the diagonal.
"""
