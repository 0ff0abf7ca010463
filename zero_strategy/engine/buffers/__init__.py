"""Flat buffers and their memory: the layout arithmetic (segments, shards, pieces), the flat groups
of parameters and gradients, the reused-buffer pool, host memory, glibc's mmap threshold.
"""
