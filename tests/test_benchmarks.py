"""The benchmarks without a GPU: their pure-Python parts (round orders, medians of
per-round ratios, row fields, case selection), their command lines (--help, --dry-run),
the programs they time (through the evaluator), and the launch-floor baseline's build."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
import torch
from conftest import ints

import codegen as cg
from benchmarks import bench_build as bb
from benchmarks import bench_matmul as bm
from benchmarks import common as il
from benchmarks import launch_floor

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("bench_matmul", "bench_layers", "bench_copy", "mlp_offload", "offload_llama",
           "offload_budget", "backward", "host_cost", "bench_overlap", "bench_build")
PROBES = ("copy2d_probe", "copy_contention", "copy_trace", "small_gemm_probe", "backward_kernels",
          "backward_streams", "host_reads", "copy_cost", "budget_trace", "budget_model",
          "stream_op_cost")


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m module args`` from the checkout's root, as the docs run it. The limit
    only stops a hang: a start that imports torch and transformers takes 15 s of a busy
    2-core machine, and its time is no part of what is tested."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                          text=True, cwd=REPO, timeout=600)


# ---------------------------------------------------------------------------- the package


@pytest.mark.parametrize("module", [f"benchmarks.{m}" for m in PRODUCT]
                         + [f"benchmarks.probes.{m}" for m in PROBES])
def test_every_benchmark_and_probe_takes_help_without_a_gpu(module):
    done = run_module(module, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ")


def test_no_benchmark_edits_sys_path_and_probes_use_only_the_shared_module():
    bench = REPO / "benchmarks"
    scripts = sorted(bench.glob("*.py")) + sorted((bench / "probes").glob("*.py"))
    assert {p.stem for p in scripts} >= set(PRODUCT) | set(PROBES) | {"common"}
    for path in scripts:
        text = path.read_text()
        assert "sys.path.insert" not in text and "sys.path[" not in text, path
        assert "python3 benchmarks/" not in text, path  # commands are python -m ...
    for path in (bench / "probes").glob("*.py"):
        for name in PRODUCT:
            assert f"benchmarks.{name} import" not in path.read_text(), (path, name)
            assert f"from benchmarks import {name}" not in path.read_text(), (path, name)
    listed = (bench / "probes" / "README.md").read_text()
    assert all(f"benchmarks.probes.{m}" in listed for m in PROBES)


# ---------------------------------------------------------------------------- interleaving


def test_rotation_puts_every_variant_in_every_position_once():
    names = ["gemm", "loop/s1", "op/s1", "graph/s1"]
    orders = [il.rotated(names, r) for r in range(len(names))]
    for position in range(len(names)):
        assert sorted(o[position] for o in orders) == sorted(names)
    assert all(sorted(o) == sorted(names) for o in orders)
    assert il.rotated(names, len(names)) == names
    assert il.rotated([], 3) == []


def test_ratio_is_median_of_per_round_ratios_not_ratio_of_medians():
    # Round times where the two summaries differ: medians 2.0 / 2.0 = 1.0, but the
    # per-round ratios are 1.0, 1.5, 3.0 (median 1.5).
    num = [1.0, 3.0, 6.0]
    den = [1.0, 2.0, 2.0]
    fields = il.ratio_fields("op_ratio", num, den)
    assert fields["op_ratio"] == 1.5
    assert fields["op_ratio_range"] == [1.0, 3.0]
    q1, q3 = fields["op_ratio_iqr"]
    assert q1 == 1.25 and q3 == 2.25  # inclusive quartiles of [1, 1.5, 3]


def test_ratio_rounds_must_pair_up():
    with pytest.raises(ValueError, match="same rounds"):
        il.per_round_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="<= 0"):
        il.per_round_ratios([1.0], [0.0])


def test_spread_of_one_value_and_of_even_counts():
    assert il.spread([2.0]) == {"median": 2.0, "q1": 2.0, "q3": 2.0, "min": 2.0, "max": 2.0}
    s = il.spread([4.0, 1.0, 3.0, 2.0])
    assert (s["median"], s["min"], s["max"]) == (2.5, 1.0, 4.0)
    assert s["q1"] == 1.75 and s["q3"] == 3.25
    with pytest.raises(ValueError):
        il.spread([])


def test_reps_for_targets_block_time_within_bounds():
    assert il.reps_for(1.5, 15.0, 3, 200) == 10
    assert il.reps_for(3.1, 15.0, 3, 200) == 5
    assert il.reps_for(10.0, 15.0, 3, 200) == 3  # at least min_reps
    assert il.reps_for(0.001, 15.0, 3, 200) == 200  # at most max_reps
    assert il.reps_for(0.0, 15.0, 3, 200) == 3
    with pytest.raises(ValueError):
        il.reps_for(1.0, 15.0, 5, 4)


def test_run_rounds_rotates_the_order_and_reads_every_round(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ran = []

    class FakeBlock:
        def __init__(self, name):
            self.name, self.runs = name, 0

        def run(self):
            ran.append(self.name)
            self.runs += 1

        def ms(self):
            return float(self.runs)

    after = []
    times = il.run_rounds({n: FakeBlock(n) for n in "abc"}, 3, after_round=after.append)
    assert ran == list("abc" "bca" "cab")
    assert times == {n: [1.0, 2.0, 3.0] for n in "abc"}
    assert after == [0, 1, 2]


@pytest.mark.parametrize("per_variant", [False, True])
def test_interleaved_chooses_reps_and_warms_up(monkeypatch, per_variant):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    events, reps = [], {}
    ms = {"a": 1.0, "b": 4.0}
    monkeypatch.setattr(il, "warm_up", lambda fn, seconds, batch: events.append(("warm", seconds)))

    def estimate(fn, calls=5):
        events.append(("estimate", fn(), calls))
        return ms[fn()]

    class FakeBlock:
        def __init__(self, fn, n):
            reps[fn()] = n

        def run(self):
            pass

        def ms(self):
            return 1.0

    monkeypatch.setattr(il, "estimate_ms", estimate)
    monkeypatch.setattr(il, "Block", FakeBlock)
    variants = {"a": lambda: "a", "b": lambda: "b"}
    if per_variant:  # bench_copy's: one count per variant, estimated before the warm-up
        times = il.interleaved(variants, 2, block_ms=15.0, min_reps=2, max_reps=20,
                               warmup_s=1.0, per_variant_reps=True)
        assert events == [("estimate", "a", 3), ("estimate", "b", 3), ("warm", 1.0)]
        assert reps == {"a": 15, "b": 4}
    else:  # bench_layers': one count from the first variant, after the warm-up
        times = il.interleaved(variants, 2)
        assert events == [("warm", 1.5), ("estimate", "a", 5)]
        assert reps == {"a": 40, "b": 40}
    assert times == {"a": [1.0, 1.0], "b": [1.0, 1.0]}
    assert il.median_ratio([2.0, 3.0, 10.0], [1.0, 1.0, 1.0]) == 3.0


def test_parse_shape_and_ints():
    assert il.parse_shape("2048") == (2048, 2048, 2048)
    assert il.parse_shape("8192^3") == (8192, 8192, 8192)
    assert il.parse_shape("16384x8192x1024") == (16384, 8192, 1024)
    for bad in ("12x", "0", "axbxc", "1x2"):
        with pytest.raises(ValueError, match="shape"):
            il.parse_shape(bad)
    assert il.parse_ints("1,4", "--slices") == (1, 4)
    with pytest.raises(ValueError, match="--slices"):
        il.parse_ints("0,2", "--slices")


# ---------------------------------------------------------------------------- bench_matmul


def test_default_cases_are_the_table_plus_linear_bias():
    labels = [c.label for c in bm.CASES]
    for shape in ("8192x8192x8192", "4096x4096x4096", "2048x2048x2048", "1024x1024x1024",
                  "16384x8192x1024", "256x4096x4096"):
        assert f"matmul bf16 {shape}" in labels
    assert "matmul fp16 8192x8192x8192" in labels
    assert "matmul fp32/tf32 8192x8192x8192" in labels
    assert "linear+bias bf16 8192x8192x8192" in labels
    assert len(labels) == len(set(labels)) == 9
    assert bm.SLICES == (1, 2, 4, 8)


def test_select_cases():
    pick = lambda spec: [c.label for c in bm.select_cases(bm.CASES, spec)]  # noqa: E731
    assert pick("2048") == ["matmul bf16 2048x2048x2048"]
    assert pick("linear") == ["linear+bias bf16 8192x8192x8192"]
    assert pick("fp32") == ["matmul fp32/tf32 8192x8192x8192"]
    assert len(pick("8192")) == 4  # bf16, fp16, fp32 matmul and linear+bias
    assert pick("matmul:bf16:8192") == ["matmul bf16 8192x8192x8192"]
    assert pick("256x4096x4096,1024") == ["matmul bf16 1024x1024x1024",
                                          "matmul bf16 256x4096x4096"]
    with pytest.raises(ValueError, match="matches no case"):
        bm.select_cases(bm.CASES, "fp16:2048")
    with pytest.raises(ValueError, match="unknown word"):
        bm.select_cases(bm.CASES, "int8")


def fake_rounds(slices, rounds=5):
    """Per-round times (ms) where op is 1.1x gemm and loop 1.2x in every round, while the
    gemm itself drifts by 10% over the rounds."""
    gemm = [1.0 + 0.1 * r / rounds for r in range(rounds)]
    times = {"gemm": gemm}
    for s in slices:
        times[f"loop/s{s}"] = [1.2 * g for g in gemm]
        times[f"op/s{s}"] = [1.1 * g for g in gemm]
        times[f"graph/s{s}"] = [1.05 * g for g in gemm]
        times[f"gemmex/s{s}"] = [1.25 * g for g in gemm]
    return times


def test_summarize_row_fields_and_values():
    case = bm.Case("matmul", "bf16", (64, 32, 16))
    times = fake_rounds([1, 4])
    variants = list(times)
    host = {v: 10.0 + i for i, v in enumerate(variants)}
    host_samples = {v: [h + 5.0, h - 1.0, h, h + 0.5, h - 0.5] for v, h in host.items()}
    errors = {v: 1e-3 for v in variants if v != "gemm"}
    reps = {v: 7 for v in variants}
    row = bm.summarize(case, 4, times, host_samples, errors, reps)
    assert set(bm.ROW_FIELDS) <= set(row)
    for old in ("shape", "dtype", "slices", "gemm_ms", "loop_ms", "op_ms", "op_host_us"):
        assert old in row
    assert row["shape"] == [64, 32, 16] and row["slices"] == 4 and row["kind"] == "matmul"
    assert row["op_ratio"] == pytest.approx(1.1)
    assert row["loop_ratio"] == pytest.approx(1.2)
    assert row["graph_ratio"] == pytest.approx(1.05)
    assert row["op_loop_ratio"] == pytest.approx(1.1 / 1.2)
    assert row["gemmex_ratio"] == pytest.approx(1.25)
    assert row["op_gemmex_ratio"] == pytest.approx(1.1 / 1.25)
    assert row["gemmex_host_us"] == host["gemmex/s4"]
    assert row["op_ratio_range"] == pytest.approx([1.1, 1.1])
    assert row["gemm_ms"] == pytest.approx(1.04)
    assert row["op_host_us"] == host["op/s4"] and row["gemm_host_us"] == host["gemm"]
    assert row["graph_host_us"] == host["graph/s4"]
    assert row["op_host_us_iqr"] == [host["op/s4"] - 0.5, host["op/s4"] + 0.5]
    assert row["host_samples"] == 5
    assert row["op_host_us_per_extra_slice"] == pytest.approx(
        (host["op/s4"] - host["op/s1"]) / 3)
    assert bm.summarize(case, 1, times, host_samples, errors,
                        reps)["op_host_us_per_extra_slice"] is None
    assert row["rounds"] == 5
    assert row["reps"] == {"gemm": 7, "loop": 7, "op": 7, "graph": 7, "gemmex": 7}
    assert row["op_tflops"] == pytest.approx(2 * 64 * 32 * 16 / (1.1 * 1.04) / 1e9)
    json.dumps(row)  # plain data
    text = bm.table([row])
    assert "matmul bf16 64x32x16" in text and "1.100 [1.100,1.100]" in text


def test_estimate_fits_the_device_budget():
    """The default run's timed part stays in the 4-5 minute budget (under 8 with start-up)."""
    seconds = bm.estimate_s(bm.CASES, bm.SLICES, bm.Config())
    assert 120 < seconds < 300
    assert bm.estimate_s(bm.QUICK_CASES, bm.QUICK_SLICES, bm.QUICK_CONFIG) < 30


@pytest.mark.parametrize("kind", bm.KINDS)
@pytest.mark.parametrize("slices", [1, 3])
def test_benchmarked_programs_match_torch(kind, slices):
    """The programs the benchmark times compute what their torch baselines compute."""
    fusion = bm.make_fusion(kind, "fp32/tf32", slices)
    m, n, k = 7, 5, 6
    if kind == "matmul":
        xs = [ints(m, k), ints(k, n)]
        ref = xs[0] @ xs[1]
    else:
        xs = [ints(m, k), ints(n, k), ints(n)]
        ref = torch.nn.functional.linear(*xs)
    (out,) = cg.evaluate(cg.lower(fusion), xs)
    assert torch.equal(out, ref)
    assert cg.lower(fusion).name == bm.program_name(kind, "fp32/tf32", slices)


def test_program_names_differ_per_kind_dtype_and_slices():
    names = {bm.program_name(k, d, s) for k in bm.KINDS for d in bm.DTYPES for s in bm.SLICES}
    assert len(names) == len(bm.KINDS) * len(bm.DTYPES) * len(bm.SLICES)
    with pytest.raises(ValueError, match="kind"):
        bm.make_fusion("conv", "bf16", 1)


def test_bench_matmul_help_and_dry_run_without_gpu():
    done = run_module("benchmarks.bench_matmul", "--help")
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout and "--shapes" in done.stdout and "--rounds" in done.stdout
    done = run_module("benchmarks.bench_matmul", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "9 cases" in done.stdout and "17 variants per round" in done.stdout
    assert "linear+bias bf16 8192x8192x8192" in done.stdout
    done = run_module("benchmarks.bench_matmul", "--quick", "--shapes", "linear",
                      "--slices", "2", "--rounds", "3", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "1 cases x S in [2]" in done.stdout and "rounds 3" in done.stdout
    done = run_module("benchmarks.bench_matmul", "--shapes", "int8", "--dry-run")
    assert done.returncode == 2 and "unknown word 'int8'" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_bench_matmul_without_gpu_says_so():
    done = run_module("benchmarks.bench_matmul", "--quick", "--no-floor")
    assert done.returncode == 1 and "needs a CUDA GPU" in done.stderr


# ---------------------------------------------------------------------------- launch floor


@pytest.mark.build
def test_launch_floor_builds_without_gpu(cache_dir):
    """The C++ loop compiles and registers its op here (it runs only on a GPU); built in
    the session's cache, so ninja rebuilds it only when the source changed."""
    home = launch_floor.cuda_home()
    if home is None:
        pytest.skip("no CUDA toolkit with headers here: the launch floor cannot be built")
    try:
        launch_floor.cublaslt_include_dirs(home)
    except launch_floor.ProbeUnavailable as e:
        pytest.skip(str(e))
    launch_floor.build(cache_dir / launch_floor.NAME)
    assert hasattr(torch.ops.bench_probe, "launch_floor_ns")
    schema = str(torch.ops.bench_probe.launch_floor_ns.default._schema)
    assert "int iters" in schema and "-> float" in schema


# ---------------------------------------------------------------------------- bench_build


def test_build_child_reports_json_line():
    out = "codegen: built x in 2.0 s\nnoise\n" + bb.MARK + json.dumps({"compile_s": 1.5})
    assert bb.parse_child(out) == {"compile_s": 1.5}
    with pytest.raises(RuntimeError, match="no result line"):
        bb.parse_child("Traceback ...")


def test_build_programs_are_new_and_distinct():
    names = [bb.program(i)[2] for i in range(4)]
    assert len(set(names)) == 4
    slices = [bb.program(i)[1] for i in range(4)]
    assert len(set(slices)) == 4


def test_build_summary_and_table():
    results = {
        "first": {"compile_s": 14.0, "wall_s": 16.5, "import_s": 2.0},
        "cold": [{"compile_s": s, "wall_s": s + 2.0, "import_s": 2.0, "slices": i + 2}
                 for i, s in enumerate((3.2, 2.8, 2.9))],
        "warm": [{"compile_s": s, "wall_s": 2.1, "import_s": 2.0} for s in (0.03, 0.02, 0.04)],
    }
    summary = bb.summarize(results)
    assert summary["first_program_s"] == 14.0
    assert summary["cold_build_median_s"] == 2.9
    assert summary["warm_load_median_s"] == 0.03
    assert summary["warm_wall_median_s"] == 2.1
    assert summary["targets"] == {"first_program_s <= 20": True,
                                  "cold_build_median_s <= 3": True,
                                  "warm_load_median_s <= 0.05": True}
    text = bb.table(results, summary)
    assert "cold build, new program" in text and "2.900" in text and "MISSED" not in text
    results["cold"][1]["compile_s"] = 3.5
    results["cold"][2]["compile_s"] = 3.1
    summary = bb.summarize(results)
    assert summary["cold_build_median_s"] == 3.2
    assert not summary["targets"]["cold_build_median_s <= 3"]
    assert "cold_build_median_s <= 3: MISSED" in bb.table(results, summary)


def test_bench_build_help_and_dry_run():
    done = run_module("benchmarks.bench_build", "--help")
    assert done.returncode == 0, done.stderr
    assert "--programs" in done.stdout
    done = run_module("benchmarks.bench_build", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "first program" in done.stdout and "cold build" in done.stdout
    assert "warm load" in done.stdout


def test_overlap_cases_cover_s_1_d_2d_4d_and_local_shapes():
    from benchmarks import bench_overlap as bo

    cases = bo.cases(2, (8192, 1024), 8192, 28672, None)
    assert {c["slices"] for c in cases} == {1, 2, 4, 8}
    assert {c["pattern"] for c in cases} == set(bo.PATTERNS)
    ag = next(c for c in cases if c["pattern"] == "allgather_matmul" and c["shape"][0] == 8192)
    rs = next(c for c in cases if c["pattern"] == "matmul_reduce_scatter")
    assert bo.local_shapes(ag) == ((4096, 8192), (8192, 14336))
    assert bo.local_shapes(rs) == ((rs["shape"][0], 4096), (4096, 28672))
    # every rank's block splits evenly into the slices
    assert all(c["shape"][0] % (c["world_size"] * c["slices"]) == 0 for c in cases)


def test_overlap_dry_run_needs_no_gpu():
    out = run_module("benchmarks.bench_overlap", "--dry-run", "--world-size", "4")
    assert out.returncode == 0, out.stderr
    assert "allgather_matmul 4 [8192, 8192, 28672] 16" in out.stdout


# ---------------------------------------------------------------------------- host_cost


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without one")
def test_host_cost_says_it_needs_a_gpu():
    done = run_module("benchmarks.host_cost")
    assert done.returncode == 1 and "needs a CUDA GPU" in done.stderr


@pytest.mark.build
def test_host_cost_ladder_builds_and_registers_each_step(cache_dir):
    from benchmarks import host_cost
    from codegen.jit import build_library

    build_library("codegen_bench_host_cost_ladder", host_cost.LADDER_SOURCE)
    for i in range(len(host_cost.LADDER)):
        overload = getattr(torch.ops.codegen_bench, f"host_cost_step{i}").default
        assert str(overload._schema) == \
            f"codegen_bench::host_cost_step{i}(Tensor a, Tensor b) -> Tensor"


def test_bench_copy_nvtx_cost_builds_and_runs_without_gpu():
    from benchmarks import bench_copy

    ns = bench_copy.nvtx_range_ns()  # None only where no CUDA toolkit is found
    assert ns is None or 0 < ns < 10_000


def test_bench_overlap_row_and_line():
    from benchmarks import bench_overlap as bo

    case = bo.cases(1, (64,), 32, 16, (2,))[0]
    times = {"overlap": [1.1, 2.2, 3.3], "local_gemm": [1.0, 2.0, 3.0],
             "no_overlap": [2.2, 4.4, 6.6]}
    row = bo.summarize(case, times)
    assert row["overlap_ms"] == 2.2 and row["async_tp_ms"] is None
    assert row["overlap_local_gemm_ratio"] == pytest.approx(1.1)
    assert row["overlap_no_overlap_ratio"] == pytest.approx(0.5)
    assert "overlap_async_tp_ratio" not in row
    line = bo._line(row)
    assert "op/local 1.100" in line and "op/no-overlap 0.500" in line
    assert "async-TP        -" in line


def test_bench_overlap_trace_draws_and_reports(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from benchmarks import bench_overlap as bo
    from codegen.tools import timeline

    ag, gemm = "ncclDevKernel_AllGather_RING_LL", "nvjet_gemm"
    events = [timeline.KernelEvent(ag, 3, 0.0, 50.0, "collective"),
              timeline.KernelEvent(gemm, 3, 50.0, 100.0),
              timeline.KernelEvent(ag, 5, 60.0, 50.0, "collective"),
              timeline.KernelEvent(gemm, 5, 150.0, 100.0)]
    monkeypatch.setattr(timeline, "profile_gpu", lambda call: events)
    case = bo.cases(2, (64,), 32, 16, (2,))[0]
    report = bo._trace(lambda: None, 4, case, str(tmp_path), rank=0)
    assert "collective time hidden under GEMMs: measured 50.0 %, planned 50.0 %" in report
    assert [p.name for p in tmp_path.iterdir()] == [
        f"overlap_trace_{case['pattern']}_{case['shape'][0]}_s2.png"]


def test_copy_trace_splits_a_sustained_trace_into_calls(monkeypatch):
    """Two calls of two slices each, by hand: copies of 300 us, GEMMs of 250 us after
    them; the second copy of a call starts 5 us after the first ends, and the next call
    starts 45 us after the last GEMM of the one before."""
    from benchmarks.probes import copy_trace
    from codegen.tools.timeline import KernelEvent

    events = []
    for c in range(2):
        t = 900.0 * c
        events += [KernelEvent("Memcpy HtoD", 1, t, 300, "HtoD", 300 * 55_000),
                   KernelEvent("gemm", 1, t + 300, 250),
                   KernelEvent("Memcpy HtoD", 2, t + 305, 300, "HtoD", 300 * 55_000),
                   KernelEvent("gemm", 2, t + 605, 250),
                   KernelEvent("memset", 2, t + 604, 1, "memset")]
    calls = []
    monkeypatch.setattr(copy_trace, "profile_gpu",
                        lambda fn, warmup: calls.append(fn) or sorted(
                            events, key=lambda e: e.start_us))
    lines = copy_trace.sustained(lambda: None, copies_per_call=2, calls=2).splitlines()
    assert len(calls) == 1
    rows = [line.split() for line in lines[1:3]]
    # call, period, copy busy, GB/s, GEMM busy, exposed (GEMM with no copy), idle, memsets
    assert rows[0] == ["0", "900.0", "600.0", "55.0", "500.0", "255.0", "45.0", "1"]
    assert rows[1] == ["1", "855.0", "600.0", "55.0", "500.0", "255.0", "0.0", "1"]


# ---------------------------------------------------------------------------- offload_llama


def test_offload_llama_buffer_plan_aligns_and_fits_the_largest_layer():
    from benchmarks import offload_llama as ol

    plan = ol.plan_buffers([[(3, 5), (2, 2)], [(10, 10)]], element_size=2, align=8)
    assert plan.offsets == [[0, 16], [0]]  # 15 elements round up to 16 (8 bytes = 4 elements)
    assert plan.numel == 100  # layer 1 (100) is larger than layer 0 (16 + 4)
    with pytest.raises(ValueError, match="multiple of the element size"):
        ol.plan_buffers([[(4,)]], element_size=4, align=6)


def test_offload_llama_buffer_plan_of_the_benchmark_model():
    pytest.importorskip("transformers")
    from benchmarks import offload_llama as ol

    shapes = ol.decoder_shapes(ol.llama_config())
    assert len(shapes) == 4 and all(len(layer) == 7 for layer in shapes)
    plan = ol.plan_buffers(shapes, element_size=2)
    for layer, offsets in zip(shapes, plan.offsets):
        ends = [o + math.prod(s) for o, s in zip(offsets, layer)]
        assert all(o * 2 % ol.ALIGN == 0 for o in offsets)
        assert all(end <= nxt for end, nxt in zip(ends, offsets[1:]))  # no overlap
        assert ends[-1] <= plan.numel
    assert plan.numel * 2 == 416 * 2**20  # q, k, v, o, gate, up, down of one layer


def replay_schedule(calls: list[int], layers: int, wrap: bool = True):
    """Drives a PrefetchSchedule through decoder-layer calls in order and checks, in the
    host order the actions are queued in, what the CUDA streams would do: a layer reads
    its own weights (the last copy into its set was of that layer), and a copy that only
    waits for its set's release never overwrites a set that a queued layer reads without
    a release recorded after it. Returns (the actions of each call, urgent copies,
    copies never read)."""
    from benchmarks import offload_llama as ol

    schedule = ol.PrefetchSchedule(layers, wrap=wrap)
    content: dict[int, int] = {}
    unreleased: set[int] = set()
    unread: set[int] = set()
    per_call, urgent, wasted = [], 0, 0
    for layer in calls:
        actions = schedule.before(layer) + schedule.after(layer)
        per_call.append(actions)
        for a in actions:
            if isinstance(a, ol.Copy):
                if a.urgent:
                    urgent += 1
                else:
                    assert a.buf not in unreleased, (layer, a)
                wasted += a.buf in unread
                content[a.buf] = a.layer
                unread.add(a.buf)
            elif isinstance(a, ol.Use):
                assert content.get(a.buf) == a.layer, (layer, a, content)
                unreleased.add(a.buf)
                unread.discard(a.buf)
            else:
                unreleased.remove(a.buf)
    return per_call, urgent, wasted


@pytest.mark.parametrize("layers", [1, 3, 4])
def test_offload_llama_prefetch_copies_the_next_layer_under_this_one(layers):
    from benchmarks import offload_llama as ol

    forwards = 3
    per_call, urgent, wasted = replay_schedule(list(range(layers)) * forwards, layers)
    assert urgent == 1 and wasted == 0  # only the very first layer waits for its copy
    for c, actions in enumerate(per_call):
        layer = c % layers
        buf, other = c % ol.SETS, (c + 1) % ol.SETS
        lead = [ol.Copy(layer, buf, urgent=True)] if c == 0 else []
        # the last layer copies layer 0 of the next forward
        assert actions == lead + [ol.Use(layer, buf), ol.Copy((layer + 1) % layers, other),
                                  ol.Release(buf)], c


@pytest.mark.parametrize("layers", [1, 2, 3, 4])
def test_offload_llama_prefetch_per_forward_copies_the_first_layer_when_it_runs(layers):
    from benchmarks import offload_llama as ol

    forwards = 3
    calls = list(range(layers)) * forwards
    per_call, urgent, wasted = replay_schedule(calls, layers, wrap=False)
    assert urgent == forwards and wasted == 0  # every forward waits for its layer 0
    for c, actions in enumerate(per_call):
        layer = c % layers
        buf, other = c % ol.SETS, (c + 1) % ol.SETS
        # layer 0 copied when it runs, even where its set still holds it (1 or 2 layers)
        lead = [ol.Copy(0, buf, urgent=True)] if layer == 0 else []
        # the last layer starts no copy
        tail = [ol.Copy(layer + 1, other)] if layer + 1 < layers else []
        assert actions == lead + [ol.Use(layer, buf), *tail, ol.Release(buf)], c
    # every layer copied once per forward; the rest as with the copy across forwards
    copies = [a.layer for actions in per_call for a in actions if isinstance(a, ol.Copy)]
    assert sorted(copies) == sorted(calls)
    wrapped, _, _ = replay_schedule(calls, layers)

    def without_layer_0_copies(per_call):
        return [[a for a in actions if not (isinstance(a, ol.Copy) and a.layer == 0)]
                for actions in per_call]
    assert without_layer_0_copies(per_call) == without_layer_0_copies(wrapped)


def test_offload_llama_prefetch_recovers_from_calls_out_of_order():
    # a forward that stops after layer 1 (the prefetched layer 2 is never read), and one
    # that starts at layer 2: each first layer copies urgently, reads stay right
    _, urgent, wasted = replay_schedule([0, 1, 0, 1, 2, 3, 2, 3, 0], layers=4)
    assert urgent == 3 and wasted == 2
    from benchmarks import offload_llama as ol

    schedule = ol.PrefetchSchedule(2)
    schedule.before(0)
    with pytest.raises(RuntimeError, match="while layer 0 runs"):
        schedule.before(1)
    with pytest.raises(RuntimeError, match="was not running"):
        schedule.after(1)
    with pytest.raises(ValueError):
        schedule.before(2)


def tiny_llama(seed: int = 0, layers: int = 3):
    """A small fp32 Llama on the CPU with random weights from ``seed``."""
    return helpers.tiny_llama(seed=seed, layers=layers, intermediate=96)


@pytest.mark.parametrize("wrap", [True, False])
def test_offload_llama_prefetch_hooks_leave_the_model_unchanged(wrap):
    """On the CPU the hooks copy synchronously: what is checked is that each layer's
    Linears read their own weights from the buffer sets, over several forwards."""
    from benchmarks import offload_llama as ol

    ref, model = tiny_llama(), tiny_llama()
    prefetch = ol.LayerPrefetch(model, wrap=wrap)
    assert prefetch.schedule.wrap is wrap
    sets = {s.untyped_storage().data_ptr() for s in prefetch.sets}
    assert len(prefetch.sets) == ol.SETS
    assert prefetch.nbytes == ol.SETS * prefetch.plan.numel * 4
    for ms in ol.decoder_linears(model):
        assert all(m.weight.untyped_storage().data_ptr() in sets for m in ms)
    for seq in (5, 9, 5):
        ids = torch.randint(0, 97, (1, seq))
        torch.testing.assert_close(ol.forward(model, ids), ol.forward(ref, ids))
    assert prefetch.schedule.calls == 3 * 3 and prefetch.schedule.running is None
    prompt, token = torch.randint(0, 97, (1, 8)), torch.tensor([[3]])
    torch.testing.assert_close(ol.DecodeStep(model, prompt, token)(),
                               ol.DecodeStep(ref, prompt, token)())


def test_offload_llama_decode_step_is_one_token_after_the_prompt():
    from benchmarks import offload_llama as ol

    model = tiny_llama(seed=1, layers=2)
    prompt, token = torch.randint(0, 97, (1, 12)), torch.tensor([[5]])
    step = ol.DecodeStep(model, prompt, token)
    full = ol.forward(model, torch.cat([prompt, token], dim=1))[:, -1:]
    for _ in range(3):  # every call: the same 12-token cache, position 12
        torch.testing.assert_close(step(), full)
        assert step.cache.get_seq_length() == 12


def test_offload_llama_rows_take_medians_of_per_round_ratios():
    from benchmarks import offload_llama as ol

    times = {"copy": [10.0, 20.0, 10.0], "codegen": [12.0, 22.0, 13.0],
             "accelerate": [100.0, 200.0, 100.0]}
    mib = {"copy": 1664.0, "codegen": 300.0, "accelerate": 900.0}
    rows = {r["variant"]: r for r in ol.summarize(512, times, mib, dict.fromkeys(mib, 0.0))}
    row = rows["codegen"]
    assert row["ms"] == 13.0 and row["rounds"] == 3
    assert row["ratio_copy"] == pytest.approx(1.2)  # the ratio of medians would be 1.3
    assert row["ratio_accelerate"] == pytest.approx(0.12)
    assert row["step"] == "prefill" and row["kv_cache"] is False
    assert row["gpu_mib"] == 300.0 and rows["copy"]["ratio_copy"] == 1.0
    decode = ol.summarize(1, {"copy": [1.0], "gpu": [0.5]}, {"copy": 1.0, "gpu": 2.0},
                          {"copy": 3.0, "gpu": 0.0})
    assert [r["kv_cache"] for r in decode] == [True, True]
    assert decode[1]["ratio_copy"] == 0.5 and decode[1]["ratio_accelerate"] is None
    json.dumps(rows)
    text = ol.table(decode)
    assert "decode" in text and text.splitlines()[2].split()[6] == "-"  # / accel
    # A quantized row's floor is its own quantized bytes' copy; x pref is tokens/s over
    # the hand-written prefetch's, per round.
    times = {"copy": [10.0, 10.0], "copy_int4": [3.0, 2.5], "codegen_int4": [3.3, 3.0],
             "prefetch": [10.0, 12.0], "codegen": [10.5, 10.0]}
    rows = {r["variant"]: r for r in ol.summarize(1, times, dict.fromkeys(times, 0.0),
                                                  dict.fromkeys(times, 0.0))}
    assert rows["codegen_int4"]["ratio_floor"] == pytest.approx(1.15)  # 1.1 and 1.2
    assert rows["codegen_int4"]["ratio_copy"] == pytest.approx(0.315)
    assert rows["codegen_int4"]["over_prefetch"] == pytest.approx(1 / ((3.3 / 10 + 3 / 12) / 2))
    assert rows["codegen"]["ratio_floor"] == rows["codegen"]["ratio_copy"] == 1.025
    assert rows["copy_int4"]["cache"] is None and rows["codegen_int4"]["cache"] == "dynamic"


def test_offload_llama_steps_and_rounds():
    from benchmarks import offload_llama as ol

    names = list(ol.VARIANTS)
    assert ol.steps([512, 1], names) == [
        (512, names), (1, ["codegen", "prefetch", "prefetch_per_forward", "gpu", "copy",
                           "codegen_fp8", "copy_fp8", "codegen_int4", "copy_int4"])]
    assert [ol._quantized(v) for v in ("codegen_fp8", "copy_int4", "codegen", "copy",
                                       "codegen_int8")] == ["fp8", "int4", None, None, None]
    assert [ol._floor_of(v) for v in ("codegen_fp8", "copy_fp8", "codegen_s4")] == [
        "copy_fp8", "copy_fp8", "copy"]
    assert ol.steps([1], ["codegen_s4", "accelerate"]) == [(1, ["codegen_s4"])]
    assert [ol._slices(v) for v in ("codegen_s4", "codegen_s16", "codegen", "codegen_s0",
                                    "codegen_s4x")] == [4, 16, None, None, None]
    assert [ol.rounds_for(t, 5) for t in (1, 512, 4096)] == [5, 5, 3]
    assert ol.rounds_for(4096, 3) == 2


def test_offload_llama_command_line_without_gpu():
    pytest.importorskip("transformers")
    done = run_module("benchmarks.offload_llama", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "prefill 4096: 3 rounds of codegen" in done.stdout
    assert ("decode (1 token, 512-token KV cache): 5 rounds of codegen, prefetch, "
            "prefetch_per_forward, gpu, copy") in done.stdout
    assert "2 buffer sets of 416.0 MiB" in done.stdout
    done = run_module("benchmarks.offload_llama", "--dry-run", "--tokens", "1",
                      "--variants", "gpu,accelerate", "--rounds", "7")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "decode (1 token, 512-token KV cache): 7 rounds of gpu"
    done = run_module("benchmarks.offload_llama", "--variants", "gpu,hand,codegen_s")
    assert done.returncode == 2 and "unknown ['hand', 'codegen_s']" in done.stderr
    done = run_module("benchmarks.offload_llama", "--dry-run", "--tokens", "512",
                      "--variants", "codegen,codegen_s4,copy")
    assert done.stdout.splitlines()[0] == "prefill 512: 5 rounds of codegen, codegen_s4, copy"
    done = run_module("benchmarks.offload_llama", "--tokens", "512,x")
    assert done.returncode == 2 and "--tokens" in done.stderr


def test_offload_llama_builds_each_prefetch(monkeypatch):
    from benchmarks import offload_budget as ob
    from benchmarks import offload_llama as ol

    monkeypatch.setattr(ol, "build", lambda config: tiny_llama())
    monkeypatch.setattr(ob, "build", lambda config: tiny_llama())
    for name, wrap in (("prefetch", True), ("prefetch_per_forward", False)):
        v = ol.make(name, None, [], {})
        assert isinstance(v.keep, ol.LayerPrefetch) and v.keep.schedule.wrap is wrap
        b = ob.make(name, None, {})
        assert isinstance(b.keep, ol.LayerPrefetch) and b.keep.schedule.wrap is wrap


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_offload_llama_without_gpu_says_so():
    pytest.importorskip("transformers")
    done = run_module("benchmarks.offload_llama", "--tokens", "512")
    assert done.returncode == 1 and "needs a CUDA GPU" in done.stderr


def test_offload_budget_dry_run_places_each_budget_of_the_8b_model():
    pytest.importorskip("transformers")
    done = run_module("benchmarks.offload_budget", "--dry-run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("offloadable: 224 Linears, 13.0 GiB; rest of the model 2.0 GiB")
    budgets = {int(line.split("%")[0]): line for line in lines[1:]}
    assert sorted(budgets) == [0, 25, 50, 75]
    assert " 0 resident (0 B), ring 208.0 MiB, streamed 13.0 GiB" in budgets[0]
    for p in (25, 50, 75):  # 13.0 GiB * p%, the ring within it
        assert f"budget {13.0 * p / 100:.1f} GiB" in budgets[p], budgets[p]


def test_offload_budget_bounds_a_quantized_row_by_the_gpu_model_plus_its_dequantization():
    """vs_floor: a row's ms over max(its copy floor, the GPU-resident model) per round; for a
    quantized row the GPU-resident model's time plus its dequant row's (a staging row of
    that format and staging), for a bf16 row the GPU-resident model's alone."""
    from benchmarks.offload_budget import Built, parse, row_names, rows_of

    times = {"gpu": [100.0, 110.0], "dequant_p0_fp8": [10.0, 10.0],
             "dequant_p0_fp8_s512": [10.0, 10.0],
             "copy_p0_fp8": [90.0, 90.0], "codegen_p0_fp8": [115.5, 126.0],
             "copy_p0_fp8_s512": [100.0, 100.0], "codegen_p0_fp8_s512": [121.0, 132.0],
             "copy_p50": [120.0, 120.0], "codegen_p50": [126.0, 126.0],
             "copy_p50_s512": [90.0, 90.0], "codegen_p50_s512": [105.0, 115.5]}
    rows = {r["variant"]: r for r in rows_of("prefill", 4096, times,
                                                {v: Built(v) for v in times})}
    assert rows["codegen_p0_fp8"]["vs_floor"] == pytest.approx(1.05)  # / (gpu + dequant)
    assert rows["codegen_p0_fp8_s512"]["vs_floor"] == pytest.approx(1.1)
    assert rows["codegen_p50"]["vs_floor"] == pytest.approx(1.05)  # / its copy floor
    assert rows["codegen_p50_s512"]["vs_floor"] == pytest.approx(1.05)  # / gpu alone
    assert rows["dequant_p0_fp8"]["vs_floor"] is None
    names = row_names(parse(["--budgets", "0,50", "--variants", "gpu,copy", "--quantize",
                             "int4", "--staging", "512"]))
    assert names == ["gpu", "codegen_p0", "copy_p0", "codegen_p50", "copy_p50",
                     "codegen_p0_int4", "copy_p0_int4", "dequant_p0_int4", "codegen_p0_s512",
                     "copy_p0_s512", "codegen_p50_s512", "copy_p50_s512",
                     "codegen_p0_int4_s512", "copy_p0_int4_s512", "dequant_p0_int4_s512"]
    # both prefetches stream every weight: bounded by the 0% floor, over the prefetch's
    times = {"gpu": [10.0, 10.0], "copy_p0": [100.0, 100.0], "prefetch": [101.0, 101.0],
             "prefetch_per_forward": [106.0, 106.0]}
    rows = {r["variant"]: r for r in rows_of("decode", 1, times,
                                                {v: Built(v) for v in times})}
    assert rows["prefetch"]["vs_floor"] == pytest.approx(1.01)
    assert rows["prefetch_per_forward"]["vs_floor"] == pytest.approx(1.06)
    assert rows["prefetch_per_forward"]["prefetch_over"] == pytest.approx(101 / 106)
    assert row_names(parse(["--budgets", "0", "--variants", "prefetch_per_forward,gpu"])) == [
        "gpu", "prefetch_per_forward"]
    assert row_names(parse(["--budgets", "0", "--variants", "prefetch,gpu"])) == [
        "gpu", "prefetch"]
    done = run_module("benchmarks.offload_budget", "--dry-run", "--staging", "0")
    assert done.returncode == 2 and "--staging: sizes in MiB, each above 0" in done.stderr
    # --prefill-plan: each budget's rows again, optimize_for="prefill", bounded by their own
    # copy floor; at 0% with no budget (the 0% budget is the decode plan's ring)
    names = row_names(parse(["--budgets", "0,50", "--variants", "gpu,copy", "--prefill-plan"]))
    assert names == ["gpu", "codegen_p0", "copy_p0", "codegen_p50", "copy_p50",
                     "codegen_p0_prefill", "copy_p0_prefill", "codegen_p50_prefill",
                     "copy_p50_prefill"]
    times = {"gpu": [100.0, 100.0], "copy_p50": [90.0, 90.0], "codegen_p50": [99.0, 99.0],
             "copy_p50_prefill": [110.0, 110.0], "codegen_p50_prefill": [121.0, 115.5],
             "accelerate_p50": [1210.0, 1155.0], "copy_p0_fp8": [50.0, 50.0],
             "codegen_p0_fp8": [100.0, 100.0], "accelerate_p0": [900.0, 900.0]}
    rows = {r["variant"]: r for r in rows_of("prefill", 4096, times,
                                                {v: Built(v) for v in times})}
    assert rows["codegen_p50_prefill"]["vs_floor"] == pytest.approx(1.075)
    assert rows["codegen_p50_prefill"]["accelerate_over"] == pytest.approx(10.0)  # same budget
    assert rows["codegen_p0_fp8"]["accelerate_over"] is None  # bf16 rows only
    from benchmarks.common import budget_and_staging
    assert budget_and_staging(None, 0, None, prefill=True) == (None, None)
    # at any other budget, the same budget as the decode plan's row
    pytest.importorskip("transformers")
    from benchmarks.common import build, config_8b, offloadable
    meta = build(config_8b(2), device="meta")
    half = sum(m.weight.numel() * 2 for _, m in offloadable(meta)) // 2
    assert budget_and_staging(meta, 50, None, prefill=True) == (half, None)
    assert budget_and_staging(meta, 50, None) == (half, None)
    done = run_module("benchmarks.offload_budget", "--dry-run", "--layers", "2", "--budgets",
                      "0,50", "--prefill-plan")
    assert done.returncode == 0, done.stderr
    rings = dict(re.findall(r"(\d+%, for \w+: [^:]+):.* ring ([\d.]+ MiB)", done.stdout))
    # two layers of 416 MiB: the 0% budget is the decode ring; the prefill plan's a layer
    assert rings == {"0%, for decode: budget 208.0 MiB": "208.0 MiB",
                     "50%, for decode: budget 416.0 MiB": "208.0 MiB",
                     "0%, for prefill: no budget": "416.0 MiB",
                     "50%, for prefill: budget 416.0 MiB": "416.0 MiB"}, done.stdout
    done = run_module("benchmarks.offload_budget", "--dry-run", "--variants", "codegen,prefech")
    assert done.returncode == 2 and "--variants: unknown prefech; choose from" in done.stderr


def test_copy_cost_fit_recovers_a_fixed_cost_and_a_bandwidth():
    from benchmarks.probes.copy_cost import fit

    total = 512 << 20
    points = [(n, total, n * 0.0042 + total / 54.3e6) for n in (4, 16, 64, 256, 1024, 8192)]
    c, bw = fit(points)
    assert abs(c - 0.0042) < 1e-9 and abs(bw - 54.3e6) < 1.0


# ---------------------------------------------------------------------------- budget_model


@pytest.mark.parametrize("percent", [0, 50])
def test_budget_model_with_instant_copies_is_the_gpu_resident_forward(percent):
    """Copies that take no time and waits and pieces that cost nothing leave the modelled
    prefill the GPU-resident forward's kernels, whatever the placement."""
    from benchmarks.probes import budget_model as bmod

    lins = bmod.linears(layers=4)
    plan, kept = bmod.offload_plan(lins, percent, None, None)
    assert len(plan.calls) == len(lins) - len(kept) and (percent == 0) == (not kept)
    rates = bmod.Rates(copy_gbps=1e12, gemm_ms=10.0, attention_ms=0.5, other_ms=0.3,
                       tail_ms=2.0, wait_us=0.0, piece_us=0.0)
    # the GEMMs of every Linear, 4 layers of attention and other kernels, the tail
    assert bmod.simulate(lins, plan, kept, rates) == pytest.approx(10.0 + 4 * 0.8 + 2.0)


@pytest.mark.parametrize("percent", [0, 50])
def test_budget_model_with_instant_compute_is_the_copy_floor_and_waits_add(percent):
    """Kernels that take no time leave the modelled prefill its copies back to back (the
    streamed bytes at the copy rate); each wait's cost adds where the copies are ahead."""
    from benchmarks.probes import budget_model as bmod

    lins = bmod.linears(layers=4)
    plan, kept = bmod.offload_plan(lins, percent, None, None)
    free = bmod.Rates(copy_gbps=50.0, gemm_ms=0.0, attention_ms=0.0, other_ms=0.0,
                      tail_ms=0.0, wait_us=0.0, piece_us=0.0)
    floor = plan.streamed_bytes / 50e6
    assert bmod.simulate(lins, plan, kept, free) == pytest.approx(floor)
    gpu = bmod.Rates(copy_gbps=1e12, gemm_ms=10.0, attention_ms=0.5, other_ms=0.3,
                     tail_ms=2.0, wait_us=20.0, piece_us=0.0)
    waits = len({p.span for c in plan.calls for p in c.pieces})
    assert bmod.simulate(lins, plan, kept, gpu) == pytest.approx(
        10.0 + 4 * 0.8 + 2.0 + waits * 0.020)


def test_budget_model_copies_wait_for_the_reads_of_the_ring_bytes_they_overwrite():
    """Under a ring of three copies and compute slower than the copies, every GEMM piece
    runs after its span's copy, a span is freed when its last piece has run, every copy
    starts after the last read of each earlier copy whose ring bytes it overwrites (found
    from the spans' places in the ring, not from the plan's waits), some copies wait for
    such reads, and the measured forward is the steady state (the first one differs)."""
    from benchmarks.probes import budget_model as bmod

    lins = bmod.linears(layers=4)
    plan, kept = bmod.offload_plan(lins, 0, 100 * 2**20, 32 * 2**20)
    assert not kept and plan.ring_bytes == 100 * 2**20
    slow = bmod.Rates(copy_gbps=50.0, gemm_ms=60.0, attention_ms=0.5, other_ms=0.3,
                      tail_ms=2.0)
    record: dict = {}
    steady = bmod.simulate(lins, plan, kept, slow, laps=3, record=record)
    copies, freed, reads = record["copies"], record["freed"], record["reads"]
    for key, pieces in reads.items():
        assert min(start for start, _ in pieces) >= copies[key][1] - 1e-9, key
        assert freed[key] == pytest.approx(max(end for _, end in pieces)), key
    occupants: list[tuple[int, int, tuple[int, int]]] = []  # (lo, hi, (span, lap))
    bound, previous_end = 0, 0.0
    for lap in range(3):
        for span in plan.spans:
            start, end = copies[(span.index, lap)]
            lo, hi = span.ring_begin, span.ring_begin + span.nbytes
            for a, b, key in occupants:
                if a < hi and lo < b:
                    assert start >= freed[key] - 1e-9, (span.index, lap, key)
                    bound += start > previous_end + 1e-9 and start == freed[key]
            occupants = [*((a, min(b, lo), k) for a, b, k in occupants if a < lo),
                         *((max(a, hi), b, k) for a, b, k in occupants if b > hi),
                         (lo, hi, (span.index, lap))]
            previous_end = end
    assert bound > 0
    assert bmod.simulate(lins, plan, kept, slow, laps=5) == pytest.approx(steady)
    assert bmod.simulate(lins, plan, kept, slow, laps=1) != pytest.approx(steady)
