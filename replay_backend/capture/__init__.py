"""Capture: CUDA graphs of the pieces per padded size, one pool and one stream, and the
memory they take."""
