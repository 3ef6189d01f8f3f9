"""The release's shards hashed for their pins beside the export: in a thread of its own, or taken from
the reads that made the compressed codes (``codes_ahead``)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Callable

from ..digest import sha256_file
from ..errors import IntegrityError
from ..progress import plural


class BackgroundHashes:
    """The shards' sha256 taken in a thread while the export runs (the trace is one core of Python;
    this is the other). ``digests()`` joins it (``compare`` then checks them against the pins, so
    nothing lands from a release whose weights are not the pinned ones); ``stop()`` ends it early
    when the build fails for another reason. Reading unverified weights is harmless: they are data,
    nothing of the release is executed, and the bundle is published only after the check."""

    def __init__(self, source: Path, names: list[str]) -> None:
        import threading

        self.source, self.names = source, names
        self._stop = threading.Event()
        self._done: dict[str, str] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="clef-shard-hashes", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buf = bytearray(8 << 20)  # sha256_file's reads, stoppable between blocks
        view = memoryview(buf)
        try:
            for name in self.names:
                h = hashlib.sha256()
                with open(self.source / name, "rb", buffering=0) as fh:
                    while not self._stop.is_set():
                        n = fh.readinto(buf)
                        if not n:
                            break
                        h.update(view[:n])
                if self._stop.is_set():
                    return
                self._done[name] = h.hexdigest()
        except BaseException as exc:  # noqa: BLE001 (re-raised in digests())
            self._error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def digests(self) -> dict[str, str]:
        self._thread.join()
        if self._error is not None:
            raise IntegrityError(f"{self.source}: hashing the shards failed: {self._error}")
        return dict(self._done)


def shard_digests(source: Path, names: list[str], ahead, hashes, log: Callable[[str], None]) -> dict[str, str]:
    """The shards' sha256: from the reads that made the codes (``ahead``), or from the thread that
    hashed them beside the export; any the process did not reach (it stopped) hashed here."""
    t0 = time.perf_counter()
    got = ahead.digests() if ahead is not None else hashes.digests()
    missing = [n for n in names if n not in got]
    for n in missing:
        got[n] = sha256_file(source / n)
    how = "from the reads that made the codes" if ahead is not None else "beside the export"
    log(f"{plural(len(names) - len(missing), 'shard')} hashed {how}" + (f", {len(missing)} after it" if missing else "")
        + f" ({time.perf_counter() - t0:.1f} s waited)")
    return {n: got[n] for n in names}
