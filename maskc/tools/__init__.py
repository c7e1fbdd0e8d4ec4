"""Tools over compiled masks: equivalence checking and notebook views.
"""
