"""Run both scripts of one variant on this rank, as tests/test_deepspeed_scripts.py's pool calls do,
in a process a launcher started (DeepSpeed's data loader starts worker processes, which the test
pool's daemonic workers cannot):

    zero-launch --num_gpus 2 --no_local_rank run_variant.py FOLDER VARIANT
"""

import os
import sys

from tests.test_deepspeed_scripts import run_variant

if __name__ == "__main__":
    import torch.distributed as dist

    folder, variant = sys.argv[1:]
    dist.init_process_group("gloo")
    run_variant(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), folder, variant)
    dist.destroy_process_group()
