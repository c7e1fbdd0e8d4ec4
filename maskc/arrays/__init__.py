"""Array algorithms the stages share: ragged ranges and bit words.
"""
