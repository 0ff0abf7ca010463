"""``zero-launch``: DeepSpeed's launcher line (``deepspeed --num_gpus=2 train.py --deepspeed_config
ds.json``) on torchrun.

    zero-launch --num_gpus 2 train.py --deepspeed_config ds.json

[Note: zero-launch]
It takes DeepSpeed's launcher flags and starts the script through torchrun (``torch.distributed.
run``, in this process), one process per device: ``--num_gpus`` (or ``--num_accelerators``) is the
number of processes on this node, on the CPU too (default: every visible CUDA device; 1 on the
CPU); ``--include`` / ``--exclude`` (``localhost:0,2``) pick device ids on this node (CUDA:
``CUDA_VISIBLE_DEVICES``; CPU: just the count); ``--master_addr`` / ``--master_port`` are the
rendezvous; ``--num_nodes N --node_rank R`` start this node's part of an N-node job: run the same
line on every node, as with torchrun (there is no ssh fan-out, so DeepSpeed's ``--hostfile`` is
refused: it names the nodes to ssh into). Each process runs the script as DeepSpeed's does:
``python script.py --local_rank=<i> <args>`` (``--no_local_rank`` leaves the flag out; ``--module``
runs ``python -m``, ``--no_python`` the program itself), with torchrun's RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and DeepSpeed's LOCAL_SIZE, CROSS_RANK and CROSS_SIZE.
The other flags of DeepSpeed's launcher are refused, each with why.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Optional, Sequence

__all__ = ["build_torchrun_arguments", "main", "parse_args"]

DEFAULT_PORT = 29500
_LOCAL_NAMES = ("localhost", "127.0.0.1")
REFUSED_FLAGS = {  # DeepSpeed's flag: why it is not taken
    "--hostfile": "a hostfile names the nodes DeepSpeed reaches over ssh; zero-launch starts this node's processes "
                  "only: run it on each node with --num_nodes N --node_rank R --master_addr <node 0>",
    "-H": "see --hostfile",
    "--launcher": "the multi-node launchers (pdsh, openmpi, slurm, ...) fan out over ssh or MPI; run zero-launch on "
                  "each node, or start the ranks with srun (init_distributed reads SLURM's variables)",
    "--launcher_args": "see --launcher",
    "--autotuning": "DeepSpeed's autotuner is not offered; set the batch sizes in the config",
    "--elastic_training": "elastic training is not supported; give a fixed --num_gpus",
    "--bind_cores_to_rank": "core binding is not done; use numactl or taskset around zero-launch, and OMP_NUM_THREADS",
    "--bind_core_list": "see --bind_cores_to_rank",
    "--enable_each_rank_log": "per-rank log files: torchrun's --log-dir/--redirects do it; run torchrun directly",
    "--ssh_port": "there is no ssh fan-out", "--venv_script": "there is no ssh fan-out",
}

_SWITCHES = ("--bind_cores_to_rank", "--elastic_training")  # DeepSpeed's flags that take no value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zero-launch", description="Start a DeepSpeed-style training script on "
                                     "this node's devices through torchrun, with DeepSpeed's launcher flags.")
    parser.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1,
                        help="processes on this node (default: every visible CUDA device; 1 on the CPU)")
    parser.add_argument("--num_nodes", type=int, default=1, help="nodes in the job (run zero-launch on each)")
    parser.add_argument("--node_rank", type=int, default=-1, help="this node's index, 0..num_nodes-1")
    parser.add_argument("--master_addr", default="", help="address of node 0 (default: this host, one node)")
    parser.add_argument("--master_port", type=int, default=DEFAULT_PORT, help="rendezvous port on node 0")
    parser.add_argument("-i", "--include", default="", help="devices to use on this node, e.g. localhost:0,2")
    parser.add_argument("-e", "--exclude", default="", help="devices not to use on this node, e.g. localhost:1")
    parser.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=<i> to the script")
    parser.add_argument("--module", action="store_true", help="run the script as a module (python -m)")
    parser.add_argument("--no_python", action="store_true", help="run the script as a program, without python")
    for flag in ("--no_ssh", "--no_ssh_check", "--force_multi", "--save_pid", "-q", "--quiet"):
        parser.add_argument(flag, action="store_true", help="accepted; nothing to do (one node, no ssh)")
    parser.add_argument("--log_level", default="info", help="accepted; torchrun logs as it does")
    for flag in (f for f in REFUSED_FLAGS if f.startswith("--")):
        if flag in _SWITCHES:
            parser.add_argument(flag, action="store_const", const=True, default=None, help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, default=None, help=argparse.SUPPRESS)
    parser.add_argument("-H", dest="hostfile_short", default=None, help=argparse.SUPPRESS)
    parser.add_argument("user_script", help="the training script (or module / program)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = parser.parse_args(argv)
    for flag in REFUSED_FLAGS:
        dest = "hostfile_short" if flag == "-H" else flag.lstrip("-")
        if getattr(args, dest, None) is not None:
            parser.error(f"{flag} is not supported: {REFUSED_FLAGS[flag]}.")
    return args


def _slots(spec: str, flag: str) -> Optional[list[int]]:
    """The device ids of this node in ``host:0,2[@host:...]``; None for a host without slots (all)."""
    chosen: Optional[list[int]] = []
    here = (*_LOCAL_NAMES, socket.gethostname())
    for part in filter(None, spec.split("@")):
        host, _, slots = part.partition(":")
        if host not in here:
            raise SystemExit(f"zero-launch: {flag} {spec!r} names host {host!r}; zero-launch starts processes on this "
                             f"node only ({', '.join(here)}): run it on {host} itself.")
        if not slots:
            return None
        try:
            ids = [int(s) for s in slots.split(",")]
        except ValueError:
            raise SystemExit(f"zero-launch: {flag} {spec!r}: the slots after ':' must be device ids such as 0,2.") from None
        chosen = sorted({*(chosen or []), *ids})
    return chosen


def _devices(args: argparse.Namespace, cuda_count: int) -> tuple[int, Optional[list[int]]]:
    """How many processes this node starts, and the CUDA device ids they see (None: as they are)."""
    if args.include and args.exclude:
        raise SystemExit("zero-launch: --include and --exclude exclude each other (as in DeepSpeed); give one.")
    available = cuda_count if cuda_count > 0 else (args.num_gpus if args.num_gpus > 0 else 1)
    ids: Optional[list[int]] = None
    if args.include:
        ids = _slots(args.include, "--include")
    elif args.exclude:
        dropped = _slots(args.exclude, "--exclude")
        ids = [] if dropped is None else [i for i in range(available) if i not in dropped]
    if ids is not None:
        bad = [i for i in ids if i >= available] if cuda_count > 0 else []
        if bad:
            raise SystemExit(f"zero-launch: device ids {bad} do not exist; this node has {cuda_count} CUDA device(s).")
        if not ids:
            raise SystemExit("zero-launch: --exclude leaves no device to run on.")
    count = len(ids) if ids is not None else (args.num_gpus if args.num_gpus > 0 else max(cuda_count, 1))
    if ids is not None and args.num_gpus > 0:
        ids = ids[: args.num_gpus]
        count = len(ids)
    if cuda_count > 0 and ids is None and count > cuda_count:
        raise SystemExit(f"zero-launch: --num_gpus {count} but this node has {cuda_count} CUDA device(s); give at "
                         f"most {cuda_count} (or DS_ACCELERATOR=cpu to run processes on the CPU).")
    return count, ids if cuda_count > 0 else None


def build_torchrun_arguments(args: argparse.Namespace, cuda_count: int) -> tuple[list[str], dict[str, str]]:
    """torchrun's command line and the variables to add, for DeepSpeed's launcher ``args``."""
    count, cuda_ids = _devices(args, cuda_count)
    if args.num_nodes < 1:
        raise SystemExit(f"zero-launch: --num_nodes {args.num_nodes} must be at least 1.")
    node_rank, address = args.node_rank, args.master_addr
    if args.num_nodes > 1:
        missing = [flag for flag, value in (("--node_rank", node_rank >= 0), ("--master_addr", address)) if not value]
        if missing:
            raise SystemExit(f"zero-launch --num_nodes {args.num_nodes}: also give {' and '.join(missing)}; "
                             "zero-launch runs on each node (no ssh fan-out), so each needs its index and node 0's "
                             "address.")
        if node_rank >= args.num_nodes:
            raise SystemExit(f"zero-launch: --node_rank {node_rank} is outside 0..{args.num_nodes - 1}.")
    node_rank = max(node_rank, 0)
    address = address or "127.0.0.1"
    mode = "module" if args.module else "program" if args.no_python else "script"
    torchrun = ["--nnodes", str(args.num_nodes), "--node-rank", str(node_rank), "--nproc-per-node", str(count),
                "--master-addr", address, "--master-port", str(args.master_port), "-m", "zero_strategy.deepspeed.rank_entry",
                mode, "1" if args.no_local_rank else "0", args.user_script, *args.user_args]
    extra = {"LOCAL_SIZE": str(count), "CROSS_RANK": str(node_rank), "CROSS_SIZE": str(args.num_nodes)}
    if cuda_ids is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = visible.split(",") if visible else [str(i) for i in range(cuda_count)]
        extra["CUDA_VISIBLE_DEVICES"] = ",".join(names[i] for i in cuda_ids)
    return torchrun, extra


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The ``zero-launch`` console script (see [Note: zero-launch])."""
    args = parse_args(argv)
    from .accelerator import get_accelerator

    cuda_count = get_accelerator().device_count() if get_accelerator()._name == "cuda" else 0
    torchrun, extra = build_torchrun_arguments(args, cuda_count)
    os.environ.update(extra)
    from torch.distributed.run import main as torchrun_main

    torchrun_main(torchrun)


if __name__ == "__main__":
    main(sys.argv[1:])
