"""kvtier's one benchmark harness (``kvtier bench COMPONENT``).

Every figure is a ratio against a baseline measured in the same run, and a
median of several repetitions.
"""
