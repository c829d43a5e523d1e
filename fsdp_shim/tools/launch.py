"""Spawn local ranks on loopback and run functions on all of them.

Used by ``fsdp-shim check``/``bench`` and by the test suite. A ``RankPool``
keeps its ranks (and their process group) alive across calls, so a test suite
pays process start-up and rendezvous once per world size.

Teardown: ``destroy_process_group()`` at interpreter exit sometimes aborts a
gloo rank with "terminate called without an active exception". Workers
therefore flush their result pipe and leave with ``os._exit``, and the parent
kills any rank that does not leave in time.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import device as torch_device


FunctionOnRank = Callable[..., Any]
ProgressSink = Callable[[str], None]

# Set in a spawned rank: its pipe to the parent, for ``report_progress``.
_parent_conn: Connection | None = None


def report_progress(text: str) -> None:
    """From a function running on the ranks: one line for the parent to show (rank 0's only).

    A no-op outside a spawned rank, so the same code runs under a user's own launcher.
    """
    if _parent_conn is not None and os.environ.get("RANK") == "0":
        _parent_conn.send(("progress", text))


def _print_to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RankError(RuntimeError):
    """A function failed on one or more ranks; the message holds their tracebacks."""


def rank_device(device_type: str) -> torch_device:
    """The device this rank computes on: the CPU, or the accelerator ``_init_process_group`` selected."""
    import torch  # noqa: PLC0415  (on a rank: this module imports without torch)

    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, getattr(torch, device_type).current_device())


def _init_process_group(rank: int, world_size: int, port: int, backend: str, timeout_s: float) -> None:
    import torch  # noqa: PLC0415  (on a rank: this module imports without torch)
    import torch.distributed as dist  # noqa: PLC0415  (as above)

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _worker(rank: int, world_size: int, port: int, backend: str, timeout_s: float, conn: Connection) -> None:
    # A rank's stdout belongs to the parent's report: whatever the backend
    # prints there (gloo 2.8-2.10: "[Gloo] Rank 0 is connected to 1 peer
    # ranks") goes to stderr instead, so `bench --json` stays valid JSON.
    global _parent_conn
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _parent_conn = conn
    try:
        _init_process_group(rank, world_size, port, backend, timeout_s)
        conn.send(("ready", None))
        while True:
            message = conn.recv()
            if message is None:
                break
            fn, args = message
            try:
                conn.send(("ok", fn(*args)))
            except BaseException:  # noqa: BLE001  (reported to the parent)
                conn.send(("error", traceback.format_exc()))
    except BaseException:  # noqa: BLE001  (reported to the parent while the pipe lasts)
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        conn.close()
        os._exit(0)  # see the module docstring: skip gloo's teardown at exit


class RankPool:
    """``world_size`` spawned ranks sharing one process group.

    ``timeout_s`` bounds start-up, and each ``run`` (unless it passes its own),
    from start to last answer: a total, not a silence between answers.
    ``on_progress`` receives rank 0's ``report_progress`` lines (default: stderr).
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout_s: float = 120.0,
                 on_progress: ProgressSink | None = _print_to_stderr):
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self._on_progress = on_progress
        started = time.monotonic()
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(rank, world_size, port, backend, timeout_s, child), daemon=True
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect("start-up", timeout_s)
        if on_progress is not None:
            on_progress(f"{world_size} ranks up ({backend}) in {time.monotonic() - started:.1f} s")

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = dict(enumerate(self._conns))
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = max(0.0, deadline - time.monotonic())
            ready = wait(list(pending.values()), timeout=left if not errors else min(left, 10.0))
            if not ready:
                break
            for conn in ready:
                rank = self._conns.index(conn)  # type: ignore[arg-type]  # wait() returns some of the Connections given
                try:
                    status, value = self._conns[rank].recv()
                except EOFError:
                    status, value = "error", "rank exited without a result (killed or crashed)"
                if status == "progress":
                    if self._on_progress is not None:
                        self._on_progress(value)
                    continue
                del pending[rank]
                if status == "ok" or status == "ready":
                    results[rank] = value
                else:
                    errors[rank] = value
        if pending or errors:
            self.close(force=True)
            lines = [f"{what} failed on {len(errors)} rank(s); {len(pending)} did not answer"]
            lines += [f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(errors.items())]
            if pending and not errors:
                lines.append(f"(no answer within {timeout_s:.0f} s: a hang or collective mismatch)")
            raise RankError("\n".join(lines))
        return results

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: FunctionOnRank, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Call ``fn(*args)`` on every rank; returns the per-rank results in rank order."""
        if not self.alive:
            raise RankError("the rank pool is closed")
        for conn in self._conns:
            conn.send((fn, args))
        return self._collect(getattr(fn, "__name__", repr(fn)), timeout_s or self.timeout_s)

    def close(self, force: bool = False) -> None:
        for conn in self._conns:
            try:
                if not force:
                    conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=0 if force else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_on_ranks(
    fn: FunctionOnRank, world_size: int, args: Sequence[Any] = (), *, backend: str = "gloo", timeout_s: float = 300.0,
    on_progress: ProgressSink | None = _print_to_stderr,
) -> list[Any]:
    """Spawn ``world_size`` ranks, run ``fn(*args)`` on each, and tear them down.

    ``timeout_s`` bounds the whole call, start-up included; past it the ranks
    are killed and ``RankError`` says so.
    """
    deadline = time.monotonic() + timeout_s
    with RankPool(world_size, backend=backend, timeout_s=timeout_s, on_progress=on_progress) as pool:
        return pool.run(fn, *args, timeout_s=max(0.001, deadline - time.monotonic()))
