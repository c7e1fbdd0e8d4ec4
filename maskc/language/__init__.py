"""The mask language: errors, the IR, the parser, the printer, the simplifier and the
Python builders. The ground floor: it imports nothing of the other stages.
"""
