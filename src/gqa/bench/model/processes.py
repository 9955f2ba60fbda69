"""A command's wall time and peak memory as a fresh process, and a file's page cache: what ``gqa bench model
--shapes`` measures load-to-first-token with, on either engine alike. Linux: a process's ``VmHWM`` is its own peak
resident set (the file pages it mapped and touched included); ``posix_fadvise(DONTNEED)`` drops a file's clean pages
that no process maps."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["cached_bytes", "drop_page_cache", "timed_process"]


def timed_process(cmd: list[str], env: dict[str, str] | None = None, poll_s: float = 0.02) -> dict:
    """Run ``cmd``; ``{"wall_s", "peak_rss_mib", "stdout"}``: exec to exit, and its own peak resident set,
    ``VmHWM`` read every ``poll_s`` while it runs (``wait4``'s ``ru_maxrss`` will not do: Linux carries the
    parent's size over fork + exec into it). ``RuntimeError`` with the end of its stderr if it fails."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        status_file = Path(f"/proc/{proc.pid}/status")
        peak_kib = 0
        while True:
            peak_kib = max(peak_kib, _hwm_kib(status_file))
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(poll_s)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{Path(cmd[0]).name} exited {proc.returncode}:\n{err.read()[-3000:]}")
        return {"wall_s": wall, "peak_rss_mib": peak_kib / 1024, "stdout": out.read()}


def _hwm_kib(status_file: Path) -> int:
    """``VmHWM`` of a ``/proc/PID/status`` (kB), 0 once the process has no memory left to report."""
    try:
        for line in status_file.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to drop ``path``'s pages from the page cache (what a cold start reads from disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_bytes(path: Path) -> int | None:
    """How many of ``path``'s bytes are in the page cache now (util-linux ``fincore``), ``None`` without it."""
    tool = shutil.which("fincore")
    if tool is None:
        return None
    proc = subprocess.run([tool, "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True,
                          text=True)  # fmt: skip
    return int(proc.stdout.split()[0]) if proc.returncode == 0 and proc.stdout.strip() else None
