"""bench/kernel_times.py: one call's kernels from ncu's CSV, named by the call's launches,
checked on CPU with ncu output made up for a plan."""

import argparse
import json
import os
import shlex
import subprocess
import sys

import pytest

from bench_scripts import BENCH, load  # tests/, beside this file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "docs", "performance", "15_kernel_times.json")

kernel_times = load("kernel_times")
perf_page = load("perf_page")
heuristics = kernel_times.heuristics
HOPPER = heuristics.gpu_of_kind("NVIDIA H200")
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def ncu_csv(kernels) -> str:
    """ncu --csv output for (name, duration, unit, grid, registers) kernels, with the lines
    of ncu and of the program around it."""
    lines = ["==PROF== Connected to process 1 (python)", "warming up", HEADER]
    for i, (name, time, unit, grid, registers) in enumerate(kernels):
        for metric, metric_unit, value in (("gpu__time_duration.sum", unit, time),
                                           ("launch__grid_size", "", grid),
                                           ("launch__registers_per_thread", "register/thread",
                                            registers)):
            lines.append(f'"{i}","1","python","h","{name}","1","14","(384, 1, 1)","(4, 64, 1)",'
                         f'"0","9.0","Command line profiler metrics","{metric}","{metric_unit}",'
                         f'"{value}"')
    return "\n".join(lines + ["==PROF== Disconnected from process 1"]) + "\n"


def case_args(*argv):
    return argparse.Namespace(
        d=64, n=8192, p=128, mix="1g15l", heads=16, batch_size=4, argv=list(argv))


TARGET = [("entry_mosaic_gpu_kernel", "83,232", "ns", 256, 168),
          ("entry_mosaic_gpu_kernel", "82,112", "ns", 120, 128),
          ("input_reduce_fusion", "31.808", "us", 15360, 31),
          ("entry_mosaic_gpu_kernel", "101,216", "ns", 256, 168),
          ("entry_mosaic_gpu_kernel", "0.139008", "ms", 256, 168),
          ("entry_mosaic_gpu_kernel", "208,768", "ns", 120, 128)]


def test_parse_reads_each_kernel_once_in_order_in_microseconds():
    kernels = kernel_times.parse_ncu_csv(ncu_csv(TARGET))
    assert [k["name"] for k in kernels] == [name for name, *_ in TARGET]
    assert [round(k["us"], 3) for k in kernels] == [83.232, 82.112, 31.808, 101.216, 139.008,
                                                    208.768]
    assert [(k["grid"], k["registers"]) for k in kernels] == [(g, r) for *_, g, r in TARGET]


@pytest.mark.parametrize("mix,want", [
    pytest.param("1g15l", ["forward, global heads: hopper forward",
                           "forward, local heads: strip forward",
                           "backward, global heads: hopper dQ",
                           "backward, global heads: hopper dK/dV",
                           "backward, local heads: strip dQ+dK/dV"], id="target-mix"),
    pytest.param("global", ["forward, global heads: hopper forward",
                            "backward, global heads: hopper dQ",
                            "backward, global heads: hopper dK/dV"], id="every-head-global"),
])
def test_kernels_are_named_by_the_launches_in_order(mix, want):
    args = case_args()
    args.mix = mix
    assert kernel_times.roles(kernel_times.case_of(args, HOPPER)) == want


def test_a_gpu_without_the_hopper_kernels_runs_one_triton_launch_a_pass():
    args = case_args()
    gpu = heuristics.gpu_of_kind("NVIDIA A100-SXM4-80GB")
    assert kernel_times.roles(kernel_times.case_of(args, gpu)) == [
        "forward, every head: triton forward", "backward, every head: triton dQ",
        "backward, every head: triton dK/dV"]


def test_table_names_xla_kernels_by_their_own_names_and_shares_add_up():
    kernels = kernel_times.parse_ncu_csv(ncu_csv(TARGET))
    args = case_args("--out", "t.json")
    table = kernel_times.table(kernels, kernel_times.roles(kernel_times.case_of(args, HOPPER)),
                               args, "NVIDIA H200, jax 0", "abc1234")
    assert [r["kernel"] for r in table["rows"]][2] == "XLA: input_reduce_fusion"
    assert sum(r["share"] for r in table["rows"]) == pytest.approx(100)
    assert table["commands"] == ["python bench/kernel_times.py --out t.json"]


def test_a_kernel_count_the_plan_does_not_give_is_refused():
    kernels = kernel_times.parse_ncu_csv(ncu_csv(TARGET[:-1]))
    args = case_args()
    with pytest.raises(SystemExit, match=r"^error: expected 5 attention kernels \(.*\), ncu "
                                         r"reported 4$"):
        kernel_times.table(kernels, kernel_times.roles(kernel_times.case_of(args, HOPPER)), args,
                           "NVIDIA H200, jax 0", "abc1234")


def run(*argv, **env):
    return subprocess.run([sys.executable, os.path.join(BENCH, "kernel_times.py"), *argv],
                          capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", **env))


def test_a_saved_csv_becomes_a_table_the_page_takes(tmp_path):
    saved, out = tmp_path / "ncu.csv", tmp_path / "tables" / "15_kernel_times.json"
    saved.write_text(ncu_csv(TARGET))
    proc = run("--csv", str(saved), "--card", "NVIDIA H200, jax 0", "--commit", "abc1234",
               "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    table = json.loads(out.read_text())
    assert table["commands"] == [f"python bench/kernel_times.py --out docs/performance/{out.name}"]
    assert len(table["rows"]) == len(TARGET)
    assert perf_page.render_table(dict(table, file="t.json")).count("\n| ") == len(TARGET) + 1


@pytest.mark.parametrize("argv,message", [
    pytest.param(["--csv", "x.csv", "--out", "t.json"], "--csv needs --card and --commit",
                 id="csv-without-card"),
    pytest.param(["--mix", "3g", "--out", "t.json"], "--mix: expected one of", id="bad-mix"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, argv, message):
    proc = run(*argv)
    assert proc.returncode != 0
    assert message in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "t.json").exists() and not os.path.exists(os.path.join(ROOT, "t.json"))


def test_profiling_without_ncu_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "t.json"
    proc = run("--out", str(out), PATH=str(tmp_path))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "error: ncu (Nsight Compute) is not on PATH"
    assert not out.exists()


def test_the_committed_table_names_its_cases_kernels():
    """Table 15's attention kernels are what the heuristics launch for its command's case on
    its card's GPU, in order."""
    with open(TABLE) as f:
        table = json.load(f)
    (command,) = table["commands"]
    args = case_args()
    argv = shlex.split(command)[2:]
    for option in ("--d", "--n", "--p", "--heads", "--batch-size"):
        if option in argv:
            setattr(args, option[2:].replace("-", "_"), int(argv[argv.index(option) + 1]))
    if "--mix" in argv:
        args.mix = argv[argv.index("--mix") + 1]
    gpu = heuristics.gpu_of_kind(table["card"].split(",")[0])
    names = [r["kernel"] for r in table["rows"] if not r["kernel"].startswith("XLA: ")]
    assert names == kernel_times.roles(kernel_times.case_of(args, gpu))
