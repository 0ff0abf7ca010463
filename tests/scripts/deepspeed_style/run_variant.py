"""Run both scripts of one variant on this rank, as tests/test_deepspeed_scripts.py does, in a
process zero-launch started (DeepSpeed's data loader starts worker processes, which the test pool's
daemonic workers cannot):

    zero-launch --num_gpus 2 run_variant.py FOLDER VARIANT

It records the ``--local_rank=<i>`` the launcher put in front of its arguments, as DeepSpeed's does,
in ``FOLDER/VARIANT/launch_rank<r>.json``.
"""

import argparse
import json
import os
from pathlib import Path

from tests.test_deepspeed_scripts import run_variant

if __name__ == "__main__":
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("folder")
    parser.add_argument("variant")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    record = {"local_rank_argument": args.local_rank, "LOCAL_SIZE": os.environ.get("LOCAL_SIZE")}
    (Path(args.folder) / args.variant / f"launch_rank{rank}.json").write_text(json.dumps(record))
    run_variant(rank, int(os.environ["WORLD_SIZE"]), args.folder, args.variant)
    dist.destroy_process_group()
