"""``add_config_arguments``: the command-line flags DeepSpeed scripts parse, and how ``initialize``
reads them back from ``args``.

[Note: where initialize finds the config]
As DeepSpeed 0.19 reads it: ``config=`` first, ``config_params=`` (the older name) only when
``config`` is None (DeepSpeed drops it silently; here a warning says so); ``args.deepscale_config``
(the old flag) is taken as ``args.deepspeed_config`` and cleared, and both set at once is an error;
``args.deepspeed_config`` together with ``config=`` is an error (DeepSpeed asserts "not sure how to
proceed"), so a script that builds its config in code (the CIFAR-10 tutorial) must leave
``--deepspeed_config`` off its command line.

[Note: args.local_rank]
The launcher's ``$LOCAL_RANK`` is the truth, as in DeepSpeed: ``args.local_rank`` (a script's
``--local_rank``, which DeepSpeed's launcher and ``zero-launch`` pass) must agree with it when it is
0 or more, and is set to it afterwards, so scripts that read ``args.local_rank`` after
``initialize`` see the real one even when they parsed -1. Without ``$LOCAL_RANK`` (no launcher),
``args.local_rank`` >= 0 says which device to use.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Optional

from .keys import DeepSpeedConfigError

__all__ = ["add_config_arguments", "config_from_arguments", "local_rank_from_arguments"]

log = logging.getLogger(__name__)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add a "DeepSpeed" group to ``parser``: ``--deepspeed`` (a flag for the script's own use),
    ``--deepspeed_config PATH`` (the JSON config ``initialize(args=args)`` reads), and their old
    names ``--deepscale`` / ``--deepscale_config``. Returns the parser."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"add_config_arguments({parser!r}): give an argparse.ArgumentParser.")
    group = parser.add_argument_group("DeepSpeed", "the ZeRO engine's options (zero_strategy, DeepSpeed's flags)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="set by the user for the script to read; the engine does not look at it")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="path of the DeepSpeed JSON config that initialize(args=args) uses")
    group.add_argument("--deepscale", default=False, action="store_true", help="old name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="old name of --deepspeed_config")
    return parser


def config_from_arguments(config: Any, config_params: Any, args: Any) -> Optional[Any]:
    """The config ``initialize`` uses, from its three sources (see [Note: where initialize finds the
    config]); None when none gives one."""
    if config is None:
        config = config_params
    elif config_params is not None:
        log.warning("initialize(config=..., config_params=...): both given; config= is used and config_params "
                    "is ignored, as DeepSpeed does. Pass one.")
    old = getattr(args, "deepscale_config", None)
    if old is not None:
        log.warning("--deepscale_config is the old name of --deepspeed_config; use --deepspeed_config.")
        if getattr(args, "deepspeed_config", None) is not None:
            raise DeepSpeedConfigError(f"initialize(args=...): both --deepscale_config ({old!r}) and --deepspeed_config "
                                       f"({args.deepspeed_config!r}) are set; give only --deepspeed_config.")
        args.deepspeed_config, args.deepscale_config = old, None
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise DeepSpeedConfigError(f"initialize(): the config comes both from --deepspeed_config ({from_args!r}) "
                                       "and from config=; DeepSpeed refuses this too. Drop one: leave "
                                       "--deepspeed_config off the command line, or do not pass config=.")
        config = from_args
    return config


def local_rank_from_arguments(args: Any, environ: Any = os.environ) -> Optional[int]:
    """``args.local_rank`` checked against ``$LOCAL_RANK`` (see [Note: args.local_rank]); the local
    rank to use, or None to let the launcher's variables decide."""
    given = getattr(args, "local_rank", None)
    if given is None:
        return None
    if isinstance(given, bool) or not isinstance(given, int):
        raise TypeError(f"initialize(args=...): args.local_rank={given!r} ({type(given).__name__}) must be an int; "
                        "parse --local_rank with type=int.")
    if "LOCAL_RANK" in environ:
        launcher = int(environ["LOCAL_RANK"])
        if given >= 0 and given != launcher:
            raise ValueError(f"initialize(args=...): args.local_rank={given} but the launcher set $LOCAL_RANK="
                             f"{launcher}; pass the --local_rank the launcher gives (or -1), or unset $LOCAL_RANK.")
        return None
    return given if given >= 0 else None


def record_local_rank(args: Any, rank: int) -> None:
    """Give ``args.local_rank`` the local rank the engine uses, as DeepSpeed does."""
    if args is not None and hasattr(args, "local_rank"):
        try:
            args.local_rank = rank
        except AttributeError:  # a read-only namespace: nothing to tell
            pass
