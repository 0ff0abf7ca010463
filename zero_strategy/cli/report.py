"""What zero-train and zero-estimate print: the config, memory tables and final metrics (rich)."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table
from rich.tree import Tree

from ..memory import KEYS

LABELS = {"params": "params", "grads": "grads", "optimizer_states": "optimizer states",
          "master_params": "fp32 master", "total": "total"}


def console() -> Console:
    # Piped output (logs, CI) gets 120 columns instead of rich's 80 so the tables do not wrap.
    return Console(width=None if os.isatty(1) else 120, highlight=False)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def print_config(cfg: DictConfig, choices: Mapping[str, Any], output_dir: str) -> None:
    """The chosen preset of every group, then each section of the resolved config as YAML."""
    out = console()
    picked = " ".join(f"{g}={choices[g]}" for g in ("model", "data", "strategy", "trainer", "callbacks", "logger",
                                                    "experiment") if g in choices and choices[g] is not None)
    tree = Tree(f"[bold]zero-train[/bold] {picked}\noutput: {output_dir}")
    for key, value in cfg.items():
        if isinstance(value, DictConfig):
            text = OmegaConf.to_yaml(value, resolve=True).rstrip()
            tree.add(f"[bold]{key}[/bold]").add(Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
        else:
            tree.add(f"[bold]{key}[/bold]: {value}")
    out.print(tree)


def print_memory_table(measured: Sequence[Mapping[str, int]], formula: Mapping[str, int], num_params: int,
                       stage: int, world_size: int, precision: str) -> None:
    table = Table(title=f"Model-state memory per rank: {num_params:,} parameters, ZeRO stage {stage} "
                        f"({'plain data parallel' if stage == 0 else 'ZeroStrategy'}), {world_size} ranks, {precision}")
    table.add_column("rank")
    table.add_column("source")
    for key in (*KEYS, "total"):
        table.add_column(LABELS[key], justify="right")
    offloaded = any(row.get("host", 0) or row.get("disk", 0) for row in measured)
    places = ("device", "host", "disk") if offloaded else ()
    for place in places:
        table.add_column(f"on {place}", justify="right")
    formula_places = formula.get("host", 0) or formula.get("disk", 0)  # computed with the offload settings
    for rank, row in enumerate(measured):
        table.add_row(str(rank), "measured", *(format_bytes(row[k]) for k in (*KEYS, "total", *places)))
        table.add_row("", "ZeRO formula", *(format_bytes(formula[k]) for k in (*KEYS, "total")),
                      *(format_bytes(formula[p]) if formula_places else "" for p in places),
                      end_section=rank == len(measured) - 1 or None)
    console().print(table)
    console().print("measured: live tensors, each storage once (memory_stats). formula: estimate_memory, the "
                    "ZeRO paper's per-rank bytes. Measured gradients at stage 2 include the reused staging "
                    "buffers of in-flight reductions (at most a few buckets of bucket_cap_mb); padding to a "
                    "multiple of the world size adds a little.")


def print_final(metrics: Mapping[str, float], extras: Mapping[str, Any]) -> None:
    table = Table(title="Final metrics")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in sorted(metrics):
        table.add_row(key, f"{metrics[key]:.4f}" if abs(metrics[key]) < 1e4 else f"{metrics[key]:,.0f}")
    for key, value in extras.items():
        table.add_row(key, str(value))
    console().print(table)


def print_estimates(rows: Sequence[Mapping[str, Any]], num_params: int, world_size: int, precision: str,
                    configured_stage: Optional[int], show_host: bool, replicas: int = 1) -> None:
    """One row per stage (and offload variant): bytes per rank from ``estimate_memory``; ``world_size``
    ranks shard it, ``replicas`` times over (hybrid sharding's shard groups)."""
    ranks = f"{world_size} ranks" if replicas == 1 else \
        f"sharded over shard groups of {world_size} ranks (shard_group_size), {replicas} replicas"
    table = Table(title=f"Estimated model-state memory per rank: {num_params:,} parameters, {ranks}, {precision}")
    table.add_column("stage", no_wrap=True)
    table.add_column("offload", no_wrap=True)
    for key in (*KEYS, "total"):
        table.add_column(LABELS[key], justify="right")
    if show_host:
        table.add_column("on device", justify="right")
        table.add_column("on host", justify="right")
        table.add_column("on disk", justify="right")
    for row in rows:
        est = row["estimate"]
        stage = f"{row['stage']}" + (" *" if row["stage"] == configured_stage and not row["offload"] else "")
        cells = [stage, row["offload"] or "-", *(format_bytes(est[k]) for k in (*KEYS, "total"))]
        if show_host:
            cells += [format_bytes(est["device"]), format_bytes(est["host"]), format_bytes(est["disk"])]
        table.add_row(*cells)
    console().print(table)
    if configured_stage is not None:
        console().print("* the configured strategy's stage. ", end="")
    console().print("Stage 0 is plain data parallelism (DDP). Activations, temporary buffers and the "
                    "framework's own memory come on top of these model states.")
    if show_host:
        console().print("Offloaded: the fp32 master, the optimizer state and the gradient shard live in host "
                        "memory (a copy of the master even for fp32 weights); opt+params also the parameter "
                        "shards; disk+params also puts the optimizer state in offload_dir files.")
