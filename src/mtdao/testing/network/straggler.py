"""A straggler site: its replica's process gets a fraction of one CPU.

A CPU cgroup quota (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``) where the machine has one;
otherwise a SIGSTOP/SIGCONT duty cycle in 100 ms periods (coarser: the process runs in bursts, so
short waits inside it stretch more than under a quota). Groups are named ``<prefix>-<pid>-<site>``
so that :func:`cleanup_stale_cgroups` can remove a killed drill's leftovers.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def cpu_cgroup_root() -> tuple[Path, str] | None:
    """The directory CPU groups are made in, and the cgroup version; None without one."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        if "cpu" in (CGROUP_ROOT / "cgroup.subtree_control").read_text().split():
            return CGROUP_ROOT, "v2"
        return None
    if (CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us").exists():
        return CGROUP_ROOT / "cpu", "v1"
    return None


class CpuQuota:
    """Limits and releases the CPU of processes, one group per site."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.root = cpu_cgroup_root()
        self.groups: dict[str, tuple[Path, int]] = {}
        self.cycles: dict[str, threading.Event] = {}

    def limit(self, site: str, pid: int, share: float) -> str:
        """Give ``pid`` ``share`` of one CPU until :meth:`release`; returns how."""
        self.release(site)
        if self.root is not None:
            try:
                return self._cgroup(site, pid, share)
            except OSError:
                pass  # a read-only or delegated-away hierarchy: fall back to signals
        stop = threading.Event()
        self.cycles[site] = stop
        threading.Thread(target=_duty_cycle, args=(pid, share, stop), daemon=True).start()
        return "SIGSTOP/SIGCONT duty cycle"

    def _cgroup(self, site: str, pid: int, share: float) -> str:
        root, version = self.root
        group = root / f"{self.prefix}-{os.getpid()}-{site}"
        group.mkdir(exist_ok=True)
        self.groups[site] = (group, pid)
        quota = max(int(PERIOD_US * share), 1000)
        if version == "v2":
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(pid))
        return f"cgroup {version} CPU quota"

    def release(self, site: str) -> None:
        if site in self.cycles:
            self.cycles.pop(site).set()
        if site in self.groups:
            group, _ = self.groups.pop(site)
            remove_group(group, self.root[0])

    def close(self) -> None:
        for site in list(self.groups) + list(self.cycles):
            self.release(site)


def _duty_cycle(pid: int, share: float, stop: threading.Event) -> None:
    period = PERIOD_US / 1e6
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGCONT)
            stop.wait(period * share)
            os.kill(pid, signal.SIGSTOP)
            stop.wait(period * (1 - share))
    except ProcessLookupError:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def remove_group(group: Path, root: Path) -> None:
    """Move the group's processes back to the root group, then remove it."""
    with contextlib.suppress(OSError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(pid)
    with contextlib.suppress(OSError):
        group.rmdir()


def cleanup_stale_cgroups(prefix: str) -> list[str]:
    """Remove CPU groups of drills with ``prefix`` whose process is gone."""
    found = cpu_cgroup_root()
    if found is None:
        return []
    root = found[0]
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-[a-z0-9]+")
    removed = []
    for group in root.iterdir():
        match = pattern.fullmatch(group.name)
        if match and group.is_dir() and not Path(f"/proc/{match.group(1)}").exists():
            remove_group(group, root)
            removed.append(group.name)
    return removed
