"""The command line: check, bench and the run launcher, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fsdp_shim.tools.launch import free_port

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _run(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, env=ENV, cwd=cwd, timeout=timeout)


def test_check_passes_and_prints_a_table():
    result = _run(sys.executable, "-m", "fsdp_shim", "check", "--verbose")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "10 passed, 0 failed, 1 skipped" in result.stdout
    assert "generate() under summon(root, recurse=False)" in result.stdout
    for name in ("iter_full_params stream", "offload_to_cpu=True, rank0_only=True", "with_grads=True"):
        assert f"\n{name}" in result.stdout, name
    hsdp = next(line for line in result.stdout.splitlines() if line.startswith("HSDP on a 2-D mesh"))
    assert "SKIP " in hsdp and "not run: needs an even world size of 4 or more (--ranks 4); this run has 2" in hsdp
    assert "route=dtensor" in result.stdout and "torch " in result.stdout
    assert "FSDP2 internals read or written: " in result.stdout and "all present: " in result.stdout
    assert "FSDPState._lazy_init" in result.stdout and "FSDPModule._apply" in result.stdout


def test_bench_json_reports_every_contender_and_ratio():
    result = _run(sys.executable, "-m", "fsdp_shim", "bench", "--layers", "2", "--width", "64",
                  "--reps", "2", "--warmup", "1", "--bucket-mb", "1", "--rank0-only", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["median_ms"]) >= {"shim", "shim_writeback", "unshard", "full_tensor_loop", "fsdp1",
                                        "per_unit_shim", "per_unit_unshard", "shim_rank0_only", "shim@1MB"}
    assert all(v > 0 for v in report["median_ms"].values())
    assert set(report["ratios"]) >= {"shim / unshard", "shim / fsdp1", "shim / full_tensor_loop",
                                     "writeback / no writeback", "per-unit loop: shim / unshard"}
    assert set(report["peak_extra_bytes"]) == set(report["median_ms"]) == set(report["iqr_ms"])
    assert set(report["median_minor_faults"]) == set(report["median_ms"])
    assert all(faults >= 0 for faults in report["median_minor_faults"].values())
    assert all(len(samples) == 2 for samples in report["samples_ms"].values())  # per repetition
    assert set(report["ratio_iqr"]) == set(report["ratios"]) and report["bucket_mb"] > 0
    assert {"torch", "wrapt", "fsdp_shim", "python"} <= set(report["versions"])
    assert "rep 2/2" in result.stderr  # progress line


def test_bench_table_lists_every_contender_with_its_page_faults():
    result = _run(sys.executable, "-m", "fsdp_shim", "bench", "--layers", "1", "--width", "32", "--reps", "1",
                  "--warmup", "0", "--no-per-unit", "--no-between", "--no-stream", "--no-fsdp1")
    assert result.returncode == 0, result.stderr
    table = result.stdout.split("\ncontender ", 1)[1].split("\n\n", 1)[0]
    header, *rows = table.splitlines()
    assert header.split()[-2:] == ["page", "faults"]
    assert [row.split()[0] for row in rows] == ["shim", "shim_writeback", "unshard", "full_tensor_loop"]
    assert all(row.split()[-1].isdigit() for row in rows)


def test_minor_faults_count_fresh_memory():
    from fsdp_shim.tools.bench import _minor_faults

    before = _minor_faults()
    fresh = bytearray(64 * 2**20)  # larger than glibc's largest mmap threshold: new pages, zeroed on first touch
    assert _minor_faults() - before >= 64 * 2**20 // 4096 // 2
    del fresh


SCRIPT = textwrap.dedent('''
    import os, sys
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
    from torch.distributed.tensor import DTensor

    # no "import fsdp_shim": the launcher patches
    print("argv", sys.argv, "name", __name__, "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Linear(5, 3))
        with FSDP.summon_full_params(model, writeback=False):
            ok = not isinstance(model.weight, DTensor) and model.weight.shape == (3, 5)
        with open(os.path.join(sys.argv[2], f"rank{dist.get_rank()}"), "w") as out:
            out.write(str(ok))
        dist.barrier()
        sys.stdout.flush()
        os._exit(int(sys.argv[1]))  # gloo's teardown at exit sometimes aborts (terminate called ...)
    sys.exit(int(sys.argv[1]))
''')


def test_run_launcher_behaves_like_python(tmp_path):
    """Same stdout (argv, __main__, sys.path[0]) and exit status as plain python."""
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    in_package = SCRIPT.replace("os.path.dirname(os.path.abspath(__file__))", "os.getcwd()")
    (tmp_path / "pkg" / "train.py").write_text(in_package)
    launchers = ([], [sys.executable, "-m", "fsdp_shim.run"], ["fsdp-shim", "run"])  # [] is plain python
    for program in (["train.py", "3", "--flag"], ["-m", "pkg.train", "4", "--help"]):
        with ThreadPoolExecutor(max_workers=2) as pool:  # fresh interpreters that import torch: two at a time
            plain, *launched = pool.map(lambda launcher, program=program: _run(
                *(launcher or [sys.executable]), *program, cwd=tmp_path), launchers)
        for run in launched:
            assert (run.returncode, run.stdout) == (plain.returncode, plain.stdout), run.stderr
        assert plain.returncode == int(program[-2]) and "name __main__ path0 True" in plain.stdout


def test_torchrun_with_the_launcher_patches_every_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = _run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                  "--master-port", str(free_port()), "-m", "fsdp_shim.run", str(script), "0", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["True", "True"]


def test_check_passes_on_three_ranks():
    """Uneven shards everywhere, and gradient averaging that is not exact."""
    result = _run(sys.executable, "-m", "fsdp_shim", "check", "--ranks", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "10 passed, 0 failed, 1 skipped" in result.stdout


def test_check_runs_hsdp_on_four_ranks():
    result = _run(sys.executable, "-m", "fsdp_shim", "check", "--ranks", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "11 passed, 0 failed" in result.stdout and "SKIPPED" not in result.stdout
    hsdp = next(line for line in result.stdout.splitlines() if line.startswith("HSDP on a 2-D mesh"))
    assert "PASS" in hsdp and "39 params exact on a (2, 2) replicate x shard mesh" in hsdp


def test_rank_output_on_stdout_never_reaches_the_report(tmp_path):
    """Backends print banners on a rank's stdout (gloo 2.8-2.10); `bench --json` must stay JSON."""
    code = textwrap.dedent('''
        import json, os
        from fsdp_shim.tools.launch import run_on_ranks

        def banner():
            os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks\\n")
            print("python print from a rank", flush=True)
            return 7

        if __name__ == "__main__":
            print(json.dumps(run_on_ranks(banner, 2)))
    ''')
    (tmp_path / "ranks.py").write_text(code)  # spawned ranks import the function from a file
    result = _run(sys.executable, "ranks.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [7, 7]
    assert "[Gloo] Rank 0" in result.stderr


def test_launcher_reports_like_python(tmp_path):
    """Missing file, unknown option, -c, --help and tracebacks, as plain python gives them."""
    missing = _run(sys.executable, "-m", "fsdp_shim.run", "nope.py", cwd=tmp_path)
    plain = _run(sys.executable, "nope.py", cwd=tmp_path)
    assert missing.returncode == plain.returncode == 2
    assert "can't open file" in missing.stderr and str(tmp_path / "nope.py") in missing.stderr
    assert "Traceback" not in missing.stderr
    bogus = _run(sys.executable, "-m", "fsdp_shim.run", "--bogus", cwd=tmp_path)
    assert bogus.returncode == 2 and "unknown option --bogus" in bogus.stderr
    code = "import sys, fsdp_shim; print(sys.argv, __name__, fsdp_shim.is_patched())"
    command = _run(sys.executable, "-m", "fsdp_shim.run", "-c", code, "a", "b", cwd=tmp_path)
    assert command.returncode == 0, command.stderr
    assert command.stdout.strip() == "['-c', 'a', 'b'] __main__ True"
    helped = _run("fsdp-shim", "run", "--help")
    assert helped.returncode == 0 and "usage: fsdp-shim run (SCRIPT | -m MODULE | -c COMMAND)" in helped.stdout
    (tmp_path / "boom.py").write_text("import os\nprint(__file__ == os.path.abspath(__file__))\n\ndef f():\n"
                                      "    raise ValueError('boom')\n\nf()\n")
    boom = _run(sys.executable, "-m", "fsdp_shim.run", "boom.py", cwd=tmp_path)
    assert boom.returncode == 1 and boom.stdout.strip() == "True"  # absolute __file__
    frames = [line for line in boom.stderr.splitlines() if line.strip().startswith("File ")]
    assert len(frames) == 2 and all("boom.py" in line for line in frames), boom.stderr  # user frames only
    assert boom.stderr.strip().endswith("ValueError: boom")


def test_kill_switch_is_honoured_by_the_launcher_and_check(tmp_path):
    code = "import fsdp_shim; print(fsdp_shim.is_patched())"
    env = {**ENV, "FSDP_SHIM_DISABLE": "yes"}
    off = subprocess.run([sys.executable, "-m", "fsdp_shim.run", "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert off.stdout.strip() == "False"
    check = subprocess.run([sys.executable, "-m", "fsdp_shim", "check"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert check.returncode == 1 and "the shim is off" in check.stdout


def test_cli_usage_errors_are_one_line():
    for args, message in ((["check", "--ranks", "0"], "--ranks must be at least 1"),
                          (["bench", "--reps", "0"], "--reps must be at least 1"),
                          (["check", "--timeout", "-1"], "--timeout must be positive")):
        result = _run(sys.executable, "-m", "fsdp_shim", *args, timeout=60)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    version = _run(sys.executable, "-m", "fsdp_shim", "--version", timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("fsdp-shim 0.")
    helped = _run(sys.executable, "-m", "fsdp_shim", "check", "--help", timeout=60)
    assert helped.returncode == 0 and "exit status:" in helped.stdout


def test_cuda_without_cuda_says_so_in_one_line():
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so a GPU machine checks the refusal too
    result = subprocess.run([sys.executable, "-m", "fsdp_shim", "check", "--device", "cuda"], capture_output=True,
                            text=True, env={**ENV, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert result.returncode == 2 and "no usable CUDA device" in result.stderr
    assert "Traceback" not in result.stderr


def test_timeout_bounds_the_whole_run_and_progress_comes_from_rank_0(tmp_path):
    """A chatty rank neither restarts the clock nor duplicates its lines per rank."""
    code = textwrap.dedent('''
        import json, sys, time
        from fsdp_shim.tools.launch import RankError, report_progress, run_on_ranks

        def chatty(seconds):
            end = time.monotonic() + seconds
            step = 0
            while time.monotonic() < end:
                step += 1
                report_progress(f"step {step}")
                time.sleep(0.25)
            return step

        if __name__ == "__main__":
            lines = []
            run_on_ranks(chatty, 2, (1.0,), timeout_s=60, on_progress=lines.append)
            start = time.monotonic()
            try:
                run_on_ranks(chatty, 2, (120.0,), timeout_s=20, on_progress=lambda line: None)
                outcome = "finished"
            except RankError as exc:
                outcome = str(exc).splitlines()[0]
            print(json.dumps({"lines": lines, "outcome": outcome, "seconds": time.monotonic() - start}))
    ''')
    (tmp_path / "ranks.py").write_text(code)
    result = _run(sys.executable, "ranks.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["lines"][0].startswith("2 ranks up (gloo)")
    steps = report["lines"][1:]
    assert steps == [f"step {n}" for n in range(1, len(steps) + 1)] and len(steps) >= 2  # rank 0's, once each
    assert report["outcome"] == "chatty failed on 0 rank(s); 2 did not answer"
    # a 20 s budget, start-up included (a loaded 2-core machine took over 8 s to start 2 ranks), plus the kill;
    # far below the 120 s the chatty ranks would take if their progress lines restarted the clock
    assert report["seconds"] < 45
