"""benchmarks/bench_stages.py end to end on a tiny model: the three files of ``--out`` and what they hold.

The figures themselves are not checked (timings on a shared machine are noise at this size); the
harness's plumbing is: every variant run, ratios and parity recorded, a markdown row each, a PNG.
The CUDA rendering (device-memory column and panel) is checked on a copy of the CPU results with
device figures added, since these machines have no GPU.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "benchmarks" / "bench_stages.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EXPECTED = ["ddp", "zero1", "zero2", "zero3", "fsdp2"]  # deepspeed3 too where DeepSpeed is installed

# 0.05M parameters -> 2 blocks of Linear 192x192 + head; 2 timed steps, no warm-up; one peak-RSS run of one
# step per variant (glibc's malloc as it comes)
TINY = ["--params-millions", "0.05", "--layers", "2", "--steps", "2", "--warmup", "0", "--memory-steps", "1",
        "--rss-malloc", "default", "--device", "cpu"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "results"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(HARNESS), *TINY, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"harness failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return out


@pytest.mark.timeout(150)
def test_out_writes_json_markdown_and_png(tiny_run):
    for name in ("results.json", "results.md", "results.png"):
        assert (tiny_run / name).stat().st_size > 0, name
    assert (tiny_run / "results.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(150)
def test_json_has_every_variant_with_ratio_parity_and_memory(tiny_run):
    result = json.loads((tiny_run / "results.json").read_text())
    variants = result["variants"]
    expected = EXPECTED + (["deepspeed3"] if "deepspeed3" not in result["left_out"] else [])
    assert sorted(variants) == sorted(expected), result["left_out"]
    assert result["config"]["baseline"] == "ddp" and result["config"]["backend"] == "gloo"
    for name, v in variants.items():
        assert v["ratio_to_baseline"] > 0 and v["paired_ratio_to_baseline"] > 0, name
        assert len(v["step_times_s"]) == 2, name
        # the same seed and batches: every variant's losses and parameters match DDP's closely
        assert v["max_loss_diff_vs_baseline"] < 1e-4, name
        assert v["max_param_diff_vs_baseline"] < 1e-4, name
        assert v["formula_bytes"] > 0, name
        assert v["model_state_bytes"]["total"] > 0, name
        assert v["peak_rss"]["default"]["train_peak_over_baseline"] > 0, name
    assert variants["ddp"]["ratio_to_baseline"] == 1.0


@pytest.mark.timeout(150)
def test_markdown_has_a_row_per_variant_and_embeds_the_plot(tiny_run):
    text = (tiny_run / "results.md").read_text()
    result = json.loads((tiny_run / "results.json").read_text())
    assert "](results.png)" in text
    main_table = text.split("\n\n| variant |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| (\w+) \| [\d.]+ \| [\d.]+x \|", main_table, re.M)
    assert rows == list(result["variants"])


@pytest.mark.timeout(150)
def test_cuda_results_render_device_memory(tiny_run, tmp_path):
    """A CUDA run's JSON (device peaks from torch.cuda.max_memory_allocated) renders a column and a panel."""
    from benchmarks import bench_stages

    result = copy.deepcopy(json.loads((tiny_run / "results.json").read_text()))
    result["config"].update(backend="nccl", device="cuda", device_name="NVIDIA H200")
    for i, v in enumerate(result["variants"].values()):
        phases = {"forward": {"device_peak": 2**20 * (i + 1), "device_end": 2**20}}
        v["peak_device"] = {"baseline": 0, "init_peak_over_baseline": 2**20, "train_peak_over_baseline": 2**21 * (i + 1),
                            "reserved_peak": 2**22, "per_rank": [], "last_step_phases_over_baseline": phases}
    report = bench_stages.render_report(result)
    assert "peak device MiB/rank (allocated)" in report and "2 nccl ranks on NVIDIA H200" in report
    assert "| zero3 |" in report.split("Device MiB/rank above the pre-model allocation", 1)[1]
    written = bench_stages.write_outputs(result, report, str(tmp_path))
    assert [Path(p).name for p in written] == ["results.json", "results.md", "results.png"]
    assert (tmp_path / "results.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(150)
def test_without_matplotlib_json_and_markdown_still_written(tiny_run, monkeypatch, tmp_path, capsys):
    from benchmarks import bench_stages

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    with pytest.raises(RuntimeError, match=r"pip install -e \"\.\[bench\]\""):
        bench_stages.plot_results({"config": {}, "variants": {}}, str(tmp_path / "results.png"))

    result = json.loads((tiny_run / "results.json").read_text())
    written = bench_stages.write_outputs(result, bench_stages.render_report(result), str(tmp_path))
    assert [Path(p).name for p in written] == ["results.json", "results.md"]
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert "results.png" not in (tmp_path / "results.md").read_text()
