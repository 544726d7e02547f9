"""How much memory a piece of work peaked at: sampled while a block runs (``PeakRss``), or the kernel's high-water
mark of this process (``process_peak_rss_bytes``)."""

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
    """The highest RSS this process has had since it started (the kernel's ru_maxrss)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
