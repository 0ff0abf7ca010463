"""The step: ``ZeroOptimizer`` over each rank's pieces, its checks, its state (consolidated and
resharded), the low-precision codecs, and the CPU tiles; the step backends are in ``step/``.
"""
