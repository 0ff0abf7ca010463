"""What each process zero-launch starts runs first: the user's script with ``--local_rank=<i>`` in
front of its arguments, as DeepSpeed's launcher passes it (see [Note: zero-launch] in deepspeed/launcher.py).

    python -m zero_strategy.deepspeed.rank_entry {script|module|program} {0|1: no --local_rank} TARGET ARGS...
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    mode, no_local_rank, target, *user_args = argv
    if no_local_rank == "0":
        user_args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *user_args]
    if mode == "program":
        os.execvp(target, [target, *user_args])
    sys.argv = [target, *user_args]
    if mode == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` puts its folder first
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
