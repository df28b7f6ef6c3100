"""Compile: each graph piece through Inductor (or as it is), identical pieces once."""
