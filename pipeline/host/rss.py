"""How much memory a piece of work peaked at: sampled while a block runs (``PeakRss``), or the kernel's high-water
mark of this process (``process_peak_rss_bytes``); and handing freed heap memory back (``trim_heap``)."""

from __future__ import annotations

import contextlib
import threading


class PeakRss:
    """Peak resident memory of this process (or of process ``pid``) and its children while a block runs (sampled
    in a thread); the one RSS sampler of forge, bench and lab.

    ``with PeakRss() as m: ...`` then ``m.peak`` (bytes, at least the value at entry and exit) and
    ``m.start`` (bytes at entry). A process that has exited counts as 0 bytes."""

    def __init__(self, interval: float = 0.2, children: bool = True, pid: int | None = None):
        import psutil
        self._psutil = psutil
        self._proc = psutil.Process(pid)
        self.interval, self.children = interval, children
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def rss(self) -> int:
        try:
            total = self._proc.memory_info().rss
            for c in (self._proc.children(recursive=True) if self.children else ()):
                with contextlib.suppress(self._psutil.Error):
                    total += c.memory_info().rss
            return total
        except self._psutil.Error:
            return 0

    def _sample(self) -> None:
        self.peak = max(self.peak, self.rss())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "PeakRss":
        self.start = self.rss()
        self.peak = max(self.peak, self.start)
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._t is not None:
            self._t.join()
        self._sample()

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


def process_peak_rss_bytes() -> int:
    """The highest RSS this process has had since it started: Linux's ``VmHWM`` (the high-water mark of this
    program's memory), else ``ru_maxrss``. Not ``ru_maxrss`` on Linux: it survives ``exec``, so a process started by
    a large one (pytest, a launcher, torchrun) reports at least its parent's size at the fork (measured: 812 MB for a
    child that used 11 MB; fs/exec.c keeps the old image's high-water mark in the signal struct's maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``, which also releases free pages inside
    the heap); a no-op elsewhere. Buffers under glibc's mmap threshold (which grows to 32 MiB once larger blocks are
    freed) stay in the heap after ``free``: after a one-shot ONNX Runtime engine on a 365 MB fp16 graph, 160 MB of
    them stayed resident, on top of which the next model was loaded (measured; 18 MB after a trim)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
