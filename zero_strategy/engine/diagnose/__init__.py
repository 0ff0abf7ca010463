"""What the engine knows when ranks part: the collective header, the rank board on the store, the
step's tally, the hang watchdog. Imports nothing else of the engine.
"""
