"""The outputs of benchmarks/bench_stages.py: the markdown report (main table, per-phase memory,
phase timings, collectives, profiles), and the files of ``--out``: results.json, results.md and
results.png (matplotlib, imported only when drawing)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Iterable


# ---- report ------------------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


RSS_TITLES = {"default": "peak RSS MiB/rank, glibc malloc", "mmap": "peak RSS MiB/rank, mmap >= 128 KiB"}
PHASE_COLUMNS = [("start", "end", "between steps"), ("forward", "peak", "forward peak"),
                 ("forward", "end", "end of forward"), ("backward", "peak", "backward peak"),
                 ("backward", "end", "end of backward"), ("opt.step", "peak", "opt.step peak")]
"""(phase, figure, column title) of the per-phase memory tables; device figures are prefixed "device_"."""


def _table(head: list[str], rows: Iterable[list[str]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _title(c: dict[str, Any]) -> str:
    backend = c.get("backend", "gloo")
    ranks = f"{c['world_size']} {backend} ranks"
    if backend == "gloo":
        ranks += f" x {c['threads_per_rank']} thread"
    where = f" on {c['device_name']}" if c.get("device_name") else ""
    return (f"### DDP, ZeRO stages and FSDP2: {c['parameters'] / 1e6:.1f}M parameters "
            f"({c['layers']} ResidualBlock(Linear {c['width']}x{c['width']}) + Linear head), "
            f"fp32 AdamW, batch {c['batch']}/rank, {ranks}{where}, bucket {c['bucket_cap_mb']} MiB, "
            f"{c['warmup']} warm-up + {c['steps']} timed steps, torch {c['torch']}")


def summary_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The main table, one row per variant: time, parity, model state against the formula, peaks."""
    vs, base = result["variants"], result["config"]["baseline"]
    has_mem = any(v["model_state_bytes"] for v in vs.values())
    has_formula = any(v["formula_bytes"] for v in vs.values())
    has_device = any(v.get("peak_device") for v in vs.values())
    rss_modes = list(dict.fromkeys(m for v in vs.values() for m in v["peak_rss"]))
    head = ["variant", "median step (s)", f"ratio vs {base}", "paired ratio", "final loss (rank 0)",
            f"max \\|Δloss\\| vs {base}", f"max \\|Δparam\\| vs {base}"]
    head += ["model-state MiB/rank (measured: params, grads, optim state, master copy)"] if has_mem else []
    head += ["MiB/rank (formula)"] if has_formula else []
    head += ["peak device MiB/rank (allocated)"] if has_device else []
    head += [RSS_TITLES[m] for m in rss_modes]
    rows = []
    for name, v in vs.items():
        row = [name, f"{v['median_step_s']:.3f}", f"{v['ratio_to_baseline']:.2f}x",
               f"{v['paired_ratio_to_baseline']:.2f}x", f"{v['final_loss_rank0']:.6f}"]
        row += (["n/a (no averaging)"] * 2 if name == "local"
                else [f"{v['max_loss_diff_vs_baseline']:.2e}", f"{v['max_param_diff_vs_baseline']:.2e}"])
        if has_mem:
            m = v["model_state_bytes"]
            master = f", master {_mib(m['master_params'])}" if m and m.get("master_params") else ""
            row.append("n/a" if m is None else f"{_mib(m['total'])} (p {_mib(m['params'])}, g {_mib(m['grads'])}, "
                                               f"os {_mib(m['optimizer_states'])}{master})")
        if has_formula:
            row.append(_mib(v["formula_bytes"]) if v["formula_bytes"] else "")
        if has_device:
            d = v.get("peak_device")
            row.append("n/a" if not d else f"{_mib(d['train_peak_over_baseline'])} "
                                           f"(reserved {_mib(d['reserved_peak'])})")
        for mode in rss_modes:
            r = v["peak_rss"].get(mode)
            row.append("n/a" if not r else f"{_mib(r['train_peak_over_baseline'])} (abs. {_mib(r['train_peak'])})")
        rows.append(row)
    return head, rows


def _phase_memory_table(vs: dict[str, Any], phases_of: Callable[[dict], dict], prefix: str) -> list[str]:
    rows = []
    for name, v in vs.items():
        ph = phases_of(v) or {}
        rows.append([name] + [_mib(ph[a][prefix + b]) if prefix + b in ph.get(a, {}) else ""
                              for a, b, _ in PHASE_COLUMNS])
    return _table(["variant"] + [t for _, _, t in PHASE_COLUMNS], rows)


def render_report(result: dict[str, Any]) -> str:
    """The report as markdown: the main table, notes, memory through a step, phases, collectives."""
    c, vs = result["config"], result["variants"]
    out = ["", _title(c), "", *_table(*summary_rows(result))]
    for name, why in result.get("left_out", {}).items():
        out += ["", f"- {name} left out: {why}"]
    if not any(v["model_state_bytes"] for v in vs.values()):
        out += ["", "(zero_strategy.memory.memory_stats is not available: measured bytes left out)"]
    if any(v.get("peak_device") for v in vs.values()):
        out += ["", "Peak device memory: each variant alone in fresh processes, the largest rank; bytes allocated by "
                    "tensors (torch.cuda.max_memory_allocated) above those allocated just before the model was "
                    "built, the caching allocator's largest reservation in brackets.",
                "", "Device MiB/rank above the pre-model allocation through the last step (largest rank):", "",
                *_phase_memory_table(vs, lambda v: (v.get("peak_device") or {}).get("last_step_phases_over_baseline"),
                                     "device_")]
    rss_modes = list(dict.fromkeys(m for v in vs.values() for m in v["peak_rss"]))
    if rss_modes:
        out += ["", "Peak RSS: each variant alone in fresh processes, "
                    f"{c['memory_steps']} training step(s), the largest rank; MiB above the resident size just before "
                    "the model was built (torch, the process group and the batches already in), absolute VmHWM in "
                    "brackets. 'glibc malloc': as a user runs it (freed tensors partly stay in the heap); "
                    "'mmap >= 128 KiB': glibc's mmap threshold set to 128 KiB (mallopt), so tensors go back to the "
                    "OS when freed and RSS follows the live ones."]
        mode = "mmap" if "mmap" in rss_modes else rss_modes[0]
        out += ["", f"RSS MiB/rank above the pre-model baseline through the last step ({RSS_TITLES[mode]}, largest "
                    "rank):", "",
                *_phase_memory_table(vs, lambda v: (v["peak_rss"].get(mode) or {}).get("last_step_phases_over_baseline"),
                                     "")]
    keys = list(dict.fromkeys(k for v in vs.values() for k in v["phases_median"]))
    out += ["", "Phases, rank 0, median seconds per step (fwd./bwd./step. prefixes: the step phase a wrapped call "
                "ran in; nested calls are also counted in their callers; page faults: a count, the whole process):",
            "", *_table(["phase", *vs], ([k] + [f"{v['phases_median'][k]:{'.0f' if 'faults' in k else '.4f'}}"
                                                if k in v["phases_median"] else "" for v in vs.values()]
                                               for k in keys))]
    if result["comm_bucket_s"]:
        out += ["", f"Collectives on one {c['bucket_cap_mb']} MiB bucket, median s "
                    "(issue: how long the async call holds the caller):", "",
                *_table(["collective", "issue", "issue + wait"],
                        ([k, f"{t['issue_s']:.4f}", f"{t['total_s']:.4f}"] for k, t in result["comm_bucket_s"].items()))]
    for name, table in result["profiles_rank0"].items():
        out += ["", f"torch.profiler, one step of {name}, rank 0:", "", "```", table, "```"]
    return "\n".join(out)


# ---- files: JSON, markdown, PNG ----------------------------------------------------------------

NO_MATPLOTLIB = ("matplotlib is not installed, so the plot (results.png) cannot be drawn: "
                 "pip install matplotlib, or pip install -e \".[bench]\" from the repository root")


def _mib_label(mib: float) -> str:
    """A bar's label: whole MiB, or one decimal below 10 (a tiny model's figures)."""
    return f"{mib:.0f}" if abs(mib) >= 10 else f"{mib:.1f}"


def matplotlib_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def plot_results(result: dict[str, Any], path: str) -> None:
    """A PNG of three panels per variant: step time over the baseline's (paired ratio bars, ratio of
    medians as dots, loss parity under each name), model-state MiB per rank measured beside the
    formula, and the peak memory per rank (device memory on CUDA, else resident memory).

    matplotlib is imported here, not at the top, so the benchmark runs without it; drawing uses
    the Agg canvas directly (no pyplot, no display, no global backend switch).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError(NO_MATPLOTLIB) from e

    c, vs = result["config"], result["variants"]
    names, base = list(vs), c["baseline"]
    xs = list(range(len(names)))
    fig = Figure(figsize=(max(12.0, 3.2 * len(names)), 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_time, ax_state, ax_peak = fig.subplots(1, 3)

    paired = [vs[n]["paired_ratio_to_baseline"] for n in names]
    bars = ax_time.bar(xs, paired, color="tab:blue", label="paired ratio (median of per-step ratios)")
    ax_time.plot(xs, [vs[n]["ratio_to_baseline"] for n in names], "_", color="black", markersize=18,
                 markeredgewidth=2, label="ratio of medians")
    ax_time.bar_label(bars, labels=[f"{r:.2f}x" for r in paired], label_type="center", color="white", fontsize=9)
    ax_time.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    parity = ["" if n in (base, "local") else f"\nΔloss {vs[n]['max_loss_diff_vs_baseline']:.2g}" for n in names]
    ax_time.set_xticks(xs, [n + p for n, p in zip(names, parity)], fontsize=8)
    ax_time.set_ylabel(f"step time / {base}'s step time")
    ax_time.set_title(f"Step time against {base}")
    ax_time.set_ylim(0, max(paired + [vs[n]["ratio_to_baseline"] for n in names]) * 1.25)
    ax_time.legend(fontsize=7, loc="upper left")

    width = 0.4
    measured = [(vs[n]["model_state_bytes"] or {}).get("total", 0) / 2**20 for n in names]
    formula = [(vs[n]["formula_bytes"] or 0) / 2**20 for n in names]
    bars = ax_state.bar([x - width / 2 for x in xs], measured, width, color="tab:green", label="measured")
    ax_state.bar_label(bars, labels=[_mib_label(m) if m else "n/a" for m in measured], padding=2, fontsize=7)
    ax_state.bar([x + width / 2 for x in xs], formula, width, color="lightgrey", edgecolor="grey", label="formula")
    ax_state.set_xticks(xs, names, fontsize=8)
    ax_state.set_ylabel("MiB per rank")
    ax_state.set_title("Model state per rank (params, grads, optimizer)")
    ax_state.set_ylim(0, max(measured + formula + [1e-9]) * 1.25)
    ax_state.legend(fontsize=7, ncols=2, loc="upper right")

    if any(v.get("peak_device") for v in vs.values()):
        series = {"device, allocated": [(vs[n].get("peak_device") or {}).get("train_peak_over_baseline", 0)
                                        for n in names]}
        peak_title = "Peak device memory per rank, training"
    else:
        modes = list(dict.fromkeys(m for v in vs.values() for m in v["peak_rss"]))
        series = {RSS_TITLES[m].split(", ", 1)[1]: [(vs[n]["peak_rss"].get(m) or {}).get("train_peak_over_baseline", 0)
                                                   for n in names] for m in modes}
        peak_title = "Peak resident memory per rank, training"
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        bars = ax_peak.bar([x + offset for x in xs], [b / 2**20 for b in values], width, label=label)
        ax_peak.bar_label(bars, labels=[_mib_label(b / 2**20) for b in values], padding=2, fontsize=7)
    ax_peak.set_xticks(xs, names, fontsize=8)
    ax_peak.set_ylabel("MiB per rank above the pre-model baseline")
    ax_peak.set_title(peak_title if series else "Peak memory: not measured (--memory-steps 0)")
    if series:
        ax_peak.set_ylim(0, max([b / 2**20 for values in series.values() for b in values] + [1e-9]) * 1.25)
        ax_peak.legend(fontsize=7, ncols=len(series), loc="upper center")

    fig.suptitle(f"{c['parameters'] / 1e6:.1f}M parameters, fp32 AdamW, batch {c['batch']}/rank, "
                 f"{c['world_size']} {c.get('backend', 'gloo')} ranks on {c.get('device_name', '?')}, "
                 f"{c['steps']} timed steps", fontsize=10)
    fig.savefig(path, dpi=100)


def write_outputs(result: dict[str, Any], report: str, out_dir: str) -> list[str]:
    """``out_dir``/results.json, results.md and (where matplotlib is installed) results.png; the paths
    written. The markdown is the printed report under a heading naming the command and the machine."""
    os.makedirs(out_dir, exist_ok=True)
    c = result["config"]
    paths = {name: os.path.join(out_dir, name) for name in ("results.json", "results.md", "results.png")}
    with open(paths["results.json"], "w") as f:
        json.dump(result, f, indent=2)
    written = [paths["results.json"]]
    plotted = matplotlib_available()
    if plotted:
        plot_results(result, paths["results.png"])
        written.append(paths["results.png"])
    else:
        print(f"note: {NO_MATPLOTLIB}", file=sys.stderr)
    header = ["# Benchmark: DDP, ZeRO stages 1-3 and FSDP2", "",
              f"`{c.get('command', 'python benchmarks/bench_stages.py')}` on {c.get('device_name', '?')}, "
              f"torch {c['torch']}, {c.get('date', '')}.", ""]
    if plotted:
        header += ["![step time against DDP, model state against the formula, peak memory](results.png)", ""]
    with open(paths["results.md"], "w") as f:
        f.write("\n".join(header) + "\n" + report.lstrip("\n") + "\n")
    written.insert(1, paths["results.md"])
    return written
