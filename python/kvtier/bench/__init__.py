"""kvtier's one benchmark harness (``kvtier bench COMPONENT``).

Every figure is a ratio against a baseline measured in the same run, and a
median of several repetitions.

A command-line tool package (runs in the ``kvtier`` process and the
child processes it starts), never imported by the library. Who calls:
:mod:`kvtier.bench.commands` (``kvtier bench``), ``bench/run.py`` and the
tests. Importing it imports nothing and never blocks; every run blocks.
"""
