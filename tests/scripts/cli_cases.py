"""Run several command lines of the console scripts one after another in this one process, each as
its console script would run it, and write what each printed and its exit code as JSON.

    python cli_cases.py OUT.json '[["zero-train", "strategy=zero9"], ["zero-estimate", "model=gpt"]]'

For command lines that end before training starts (bad overrides, zero-estimate): starting a
process that imports Lightning costs more than such a run, so tests/test_cli.py starts one for all
of them. Each run gets what a fresh process has where it matters: its own ``sys.argv``, Hydra's
global state cleared, and file descriptors 1 and 2 redirected to files of its own (so whatever
writes there, Python, Hydra's logging or rich, is captured). Its exit code is what the console
script would have returned: the code of the SystemExit that ended ``main()``, 1 for an exception
(printed, as Python would), else what ``main()`` returned (``sys.exit(main())``, as the console
script does).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import traceback

from hydra.core.global_hydra import GlobalHydra

ENTRY_POINTS = {"zero-train": "zero_strategy.cli.train", "zero-estimate": "zero_strategy.cli.estimate"}


def run_one(argv: list[str]) -> dict:
    main = importlib.import_module(ENTRY_POINTS[argv[0]]).main
    saved_argv, saved_fds = sys.argv, (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = list(argv)
        try:
            code = main() or 0  # a console script exits with what main() returns
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except Exception:  # noqa: BLE001 - reported as Python would, with exit code 1
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            sys.argv = saved_argv
            GlobalHydra.instance().clear()
        out.seek(0)
        err.seek(0)
        return {"argv": argv, "returncode": code, "stdout": out.read(), "stderr": err.read()}


def main() -> None:
    target, cases = sys.argv[1], json.loads(sys.argv[2])
    with open(target, "w") as f:
        json.dump([run_one(argv) for argv in cases], f)


if __name__ == "__main__":
    main()
