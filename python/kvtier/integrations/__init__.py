"""Engine integrations. Each module here is the only place its engine is imported.

Runs in whichever process loads an integration (an engine's processes,
or a command-line tool's for the benchmarks); importing the package itself
imports nothing and never blocks.

Process: the engine's processes or a tool's. Who calls: engines load the
integrations by module path.
"""
