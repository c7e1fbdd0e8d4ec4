"""What a mask means: binding to a shape and operands, evaluation at positions, the
range analysis over rectangles of positions, integer overflow bounds, and operands in
run-length form.
"""
