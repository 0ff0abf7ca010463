"""Every byte the engine sends: the collectives over one process group and its subgroups, the bytes
counted, block quantization, hybrid sharding's groups, and the order guard on stage 3's gathers.
"""
