#!/usr/bin/env python3
"""Run the whole suite and ``fsdp-shim check`` on several torch releases; print a table.

    python scripts/matrix.py                 # every release in _versions.VERIFIED_TORCH
    python scripts/matrix.py 2.7.0 2.14.1    # just these
    python scripts/matrix.py --newest        # the newest torch pip can see: the canary for a new release
    python scripts/matrix.py --vllm          # add the vLLM row: tests/test_vllm_source.py on vLLM 0.33.0

One venv per release under ``--cache``, reused while it holds that exact release; the project (editable, its
test extras, the release's ``CLIENT_PINS``) is reinstalled into it every run. The oldest verified torch's row is
also the floor row: setup.cfg's other lower bounds installed exactly (``floor_pins``); each row reports its wrapt.
Torch wheels are downloaded once into ``CACHE/wheels``, any pip constraint lifted (``PIP_CONSTRAINT=/dev/null``:
``--newest`` must see past a cap). The vLLM row (``VLLM_ROW``): vLLM ``--no-deps`` in a venv of its own, its
tests alone, ``FSDP_SHIM_REQUIRE_VLLM=1`` (never skipped). Standard library only. Exit status 1 if a row failed.
"""

from __future__ import annotations

import argparse
import configparser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _versions_module():
    """``fsdp_shim/_versions.py`` without importing the package (which imports torch)."""
    spec = importlib.util.spec_from_file_location("_fsdp_shim_versions", ROOT / "fsdp_shim" / "_versions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def floor_pins(setup_cfg: Path = ROOT / "setup.cfg") -> tuple[str, ...]:
    """Every ``name>=X`` of setup.cfg's ``install_requires`` but torch (the row's own), as ``name==X``."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(setup_cfg)
    pins = []
    for line in parser.get("options", "install_requires").splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([^\s,;]+)", line.strip())
        if match is not None and match.group(1).lower() != "torch":
            pins.append(f"{match.group(1)}=={match.group(2)}")
    if not any(pin.startswith("wrapt==") for pin in pins):
        raise RuntimeError(f"{setup_cfg}: no wrapt>=X in [options] install_requires")
    return tuple(pins)


@dataclass(frozen=True)
class ClientRow:
    """A row that runs a few test files against a client installed without its dependencies."""

    name: str  # the venv's and the table's suffix
    torch: str
    no_deps: tuple[str, ...]  # installed with ``pip install --no-deps``
    deps: tuple[str, ...]  # the few of their dependencies the tests import
    tests: tuple[str, ...]  # what pytest runs (nothing else: the full rows run the suite)
    env: tuple[tuple[str, str], ...] = ()


#: vLLM's weight-transfer API against ``fsdp_shim.vllm_weight_source``: its modules import on the CPU beside
#: torch 2.14.x with vLLM ``--no-deps`` and these pure-Python packages (pinned).
VLLM_ROW = ClientRow(
    name="vllm", torch="2.14.1", no_deps=("vllm==0.33.0",),
    deps=("pyzmq==27.3.0", "urllib3==2.8.0", "cbor2==6.3.0", "aiohttp==3.14.5", "requests==2.34.2",
          "openai-harmony==0.0.8", "openai==3.60.0", "pybase64==1.5.1"),
    tests=("tests/test_vllm_source.py",), env=(("FSDP_SHIM_REQUIRE_VLLM", "1"),),
)


@dataclass
class Row:
    torch: str
    client: str = ""  # a ClientRow's name, else ""
    python: str = ""  # the venv's Python, major.minor
    installed: str = ""  # torch.__version__ as the venv reports it
    wrapt: str = ""  # the venv's wrapt
    floor: bool = False  # installed at setup.cfg's lower bounds (``floor_pins``)
    install_s: float = 0.0
    pytest: str = "not run"
    pytest_ok: bool = False
    pytest_s: float = 0.0
    check: str = "not run"
    check_ok: bool = False
    check_s: float = 0.0
    log: str = ""

    @property
    def ok(self) -> bool:
        return self.pytest_ok and self.check_ok


def _run(cmd: list[str], log, env: dict[str, str] | None = None, timeout: float | None = None) -> tuple[int, str]:
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log.write(out + f"\n[timed out after {timeout} s]\n")
        return 124, out
    log.write(proc.stdout + proc.stderr)
    log.flush()
    return proc.returncode, proc.stdout + proc.stderr


_PYTEST = re.compile(r"^=*\s*(\d+ (passed|failed|error|errors|skipped)[^=]*?)\s*(in [\d.]+s.*?)?=*\s*$")
_CHECK = re.compile(r"^(\d+ passed, \d+ failed(, \d+ skipped)?)$")


def _summary(output: str, pattern: re.Pattern[str]) -> str:
    """The last line of ``output`` that ``pattern`` matches, as its first group says it."""
    for line in reversed(output.splitlines()):
        match = pattern.match(line.strip())
        if match:
            return match.group(1).strip().rstrip(",")
    return "no summary"


def _venv_version(python: Path, distribution: str = "torch") -> str:
    if not python.exists():
        return ""
    proc = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({distribution!r}))"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _python_version(interpreter: str) -> str:
    proc = subprocess.run([interpreter, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, check=True)
    return proc.stdout.strip()


def _venv_name(version: str, python_version: str, client: str = "") -> str:
    """``torch-X`` on this interpreter's Python (the name CI's cache already holds), else ``torch-X-pyM.N``;
    a client row's venv adds ``-NAME``, so that its client never reaches a full row's venv."""
    same = python_version == "%d.%d" % sys.version_info[:2]
    name = f"torch-{version}" if same else f"torch-{version}-py{python_version}"
    return f"{name}-{client}" if client else name


#: Client packages a row installs beside the project, with its test extras: compose-rl's pins on its torch (the
#: real Composer: test_composer_real.py); torchao for float8 and NF4 from torch 2.11, its floor, as the README.
CLIENT_PINS: dict[str, tuple[str, ...]] = {"2.7.0": ("mosaicml==0.32.1", "transformers==4.51.3"),
                                           "2.15.0": ("torchao==0.18.0",)}

#: pip's global constraint file, if any, lifted for the install steps (see the module docstring).
_UNCAPPED = {"PIP_CONSTRAINT": os.devnull}


def newest_torch(interpreter: str = sys.executable) -> str:
    """The newest torch release pip can see, with any constraint lifted (``pip index versions``)."""
    proc = subprocess.run([interpreter, "-m", "pip", "index", "versions", "torch"], capture_output=True, text=True,
                          env={**os.environ, **_UNCAPPED}, check=True)
    match = re.search(r"^torch \(([^)]+)\)", proc.stdout, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"pip index versions torch said nothing usable:\n{proc.stdout}{proc.stderr}")
    return match.group(1)


def run_release(version: str, cache: Path, logs: Path, pytest_args: list[str], timeout: float,
                interpreter: str = sys.executable, floor: bool = False, client: ClientRow | None = None) -> Row:
    """One row; with ``floor``, the project's other dependencies at their declared lower bounds; with
    ``client``, that client row (its packages, its tests only, no ``fsdp-shim check``)."""
    row = Row(version, client=client.name if client else "", python=_python_version(interpreter), floor=floor)
    name = _venv_name(version, row.python, row.client)
    venv = cache / "venvs" / name
    python = venv / "bin" / "python"
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}.log"
    row.log = str(log_path)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "VIRTUAL_ENV": str(venv), "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    with open(log_path, "w") as log:
        start = time.perf_counter()
        if _venv_version(python).split("+")[0] != version:
            shutil.rmtree(venv, ignore_errors=True)
            steps = [
                [interpreter, "-m", "venv", str(venv)],
                [str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
                [str(python), "-m", "pip", "download", "--quiet", "--dest", str(wheels), f"torch=={version}"],
                [str(python), "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels),
                 f"torch=={version}"],
            ]
            for step in steps:
                code, _ = _run(step, log, {**env, **_UNCAPPED})
                if code != 0:
                    row.pytest = row.check = f"install failed (exit {code})"
                    return row
        pins = (*CLIENT_PINS.get(version, ()), *(floor_pins() if floor else ()))
        code, _ = _run([str(python), "-m", "pip", "install", "--quiet", "-e", ".[test]", *pins], log,
                       {**env, **_UNCAPPED})
        if code != 0:
            row.pytest = row.check = f"project install failed (exit {code})"
            return row
        if client is not None:
            for packages, flags in ((client.no_deps, ["--no-deps"]), (client.deps, [])):
                code, _ = _run([str(python), "-m", "pip", "install", "--quiet", *flags, *packages], log,
                               {**env, **_UNCAPPED})
                if code != 0:
                    row.pytest = row.check = f"client install failed (exit {code})"
                    return row
            env.update(client.env)
        row.installed = _venv_version(python)
        row.wrapt = _venv_version(python, "wrapt")
        row.install_s = time.perf_counter() - start

        start = time.perf_counter()
        tests = list(client.tests) if client is not None else []
        code, out = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, *pytest_args], log,
                         env, timeout)
        row.pytest_s = time.perf_counter() - start
        row.pytest, row.pytest_ok = _summary(out, _PYTEST), code == 0

        if client is not None:
            row.check, row.check_ok = "not run (client row)", True
            return row
        start = time.perf_counter()
        code, out = _run([str(python), "-m", "fsdp_shim", "check"], log, env, timeout)
        row.check_s = time.perf_counter() - start
        row.check, row.check_ok = _summary(out, _CHECK), code == 0
    return row


def _wrapt_cell(row: Row) -> str:
    return f"{row.wrapt or '?'} (floor)" if row.floor else row.wrapt


def print_table(rows: list[Row]) -> None:
    header = (f"| {'torch':<8} | {'python':<6} | {'installed':<14} | {'wrapt':<13} | {'pytest':<28} "
              f"| {'fsdp-shim check':<16} | {'minutes':>7} |")
    print(header)
    print("|" + "|".join("-" * (len(cell) + 0) for cell in header.split("|")[1:-1]) + "|")
    for row in rows:
        minutes = (row.install_s + row.pytest_s + row.check_s) / 60
        mark = "" if row.ok else " FAIL"
        torch_cell = f"{row.torch}+{row.client}" if row.client else row.torch
        print(f"| {torch_cell:<8} | {row.python:<6} | {row.installed:<14} | {_wrapt_cell(row):<13} "
              f"| {row.pytest + mark:<28} | {row.check:<16} | {minutes:>7.1f} |")


def main(argv: list[str] | None = None) -> int:
    versions = _versions_module()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("torch", nargs="*", help="releases (default: every verified one; with --newest alone, none)")
    parser.add_argument("--newest", action="store_true", help="add the newest torch pip can see (any pip cap lifted)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "fsdp-shim-matrix",
                        help="venvs and downloaded wheels (default: ~/.cache/fsdp-shim-matrix)")
    parser.add_argument("--logs", type=Path, default=ROOT / ".matrix-logs", help="a log per row (default .matrix-logs)")
    parser.add_argument("--vllm", action="store_true", help=f"add the vLLM row: {', '.join(VLLM_ROW.tests)} on torch "
                        f"{VLLM_ROW.torch} with {', '.join(VLLM_ROW.no_deps)}")
    parser.add_argument("--remove-venvs", action="store_true", help="delete each venv once its row is done")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for each pytest or check run")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    parser.add_argument("--python", default=sys.executable, help="the venvs' interpreter (default: this one)")
    args = parser.parse_args(argv)
    python_version = _python_version(args.python)
    releases = list(args.torch) or ([] if args.newest or args.vllm else list(versions.VERIFIED_TORCH))
    if args.newest:
        newest = newest_torch(args.python)
        print(f"matrix: the newest torch pip can see is {newest}", flush=True)
        if newest not in releases:
            releases.append(newest)

    # The floor row: the oldest verified torch, its own venv, so the exact pins never reach another row's.
    floor_torch = min(versions.VERIFIED_TORCH, key=versions.parse_version)
    rows: list[Row] = []
    for version, client in [(v, None) for v in releases] + ([(VLLM_ROW.torch, VLLM_ROW)] if args.vllm else []):
        floor = client is None and version == floor_torch
        what = (f" with {', '.join(client.no_deps)} (--no-deps): {', '.join(client.tests)}" if client is not None
                else f" (floor row: {', '.join(floor_pins())})" if floor else "")
        print(f"matrix: torch {version}{what} ...", flush=True)
        row = run_release(version, args.cache, args.logs, args.pytest_args.split(), args.timeout, args.python,
                          floor=floor, client=client)
        rows.append(row)
        print(f"matrix: torch {version}{'+' + row.client if row.client else ''}: wrapt {_wrapt_cell(row) or '?'}; "
              f"pytest {row.pytest}; check {row.check}; log {row.log}", flush=True)
        if args.remove_venvs:
            shutil.rmtree(args.cache / "venvs" / _venv_name(version, python_version, row.client), ignore_errors=True)
    print(f"\nfsdp_shim version matrix, {time.strftime('%Y-%m-%d')}, Python {python_version}\n")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
