"""One run per output directory: an exclusive lock that a crashed run cannot leave behind.

Two runs writing to one ``output_dir`` would interleave ``metrics.jsonl`` and replace each other's
checkpoints. A run takes ``{output_dir}/.run.lock`` with ``flock`` (exclusive, non-blocking) for as long as it
runs; the operating system releases the lock when the process ends in any way (exit, exception, SIGKILL,
out-of-memory kill), so a stale lock cannot block the next start or a resume. The file itself stays; it holds
the owner's host, pid, start time and command line, which a refused second run shows.

``flock`` works on local file systems and on most network ones (NFSv4, Lustre and GPFS implement it, NFSv3
only with the lock daemon). On one that does not support it at all the lock is not taken and a warning says so.
"""

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

__all__ = ["check_output_dir", "LOCK_FILE", "OutputDirBusy", "OutputDirLock"]

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"


class OutputDirBusy(RuntimeError):
    """Another live run holds the output directory."""


class OutputDirLock:
    """The exclusive lock of one run on its output directory.

    Args:
        output_dir (str): the run's ``output_dir`` (must exist).

    Example::

        lock = OutputDirLock(output_dir).acquire()   # raises OutputDirBusy naming the other run
        ...                                          # train, save
        lock.release()                               # or let the process end
    """

    def __init__(self, output_dir: str) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> "OutputDirLock":
        """Take the lock and record this process as its owner.

        Returns:
            OutputDirLock: ``self``.

        Raises:
            OutputDirBusy: when another process holds it; the message names that process (host, pid, start,
                command) and the directory.
        """
        if self._fd is not None:
            return self
        # O_CREAT without O_TRUNC: a refused run must not erase the owner's record.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            owner = _read_owner(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputDirBusy(
                    f"output_dir={str(self.path.parent)!r} is in use by another run ({owner}; lock file "
                    f"{self.path}). Two runs in one directory would interleave metrics.jsonl and replace each "
                    "other's checkpoints: wait for it to end, stop it, or set output_dir to another directory."
                ) from None
            # ENOLCK / EOPNOTSUPP: a file system without flock. Run, but say that nothing guards the directory.
            log.warning(f"Could not lock {self.path} ({os.strerror(e.errno)}): nothing stops a second run "
                        "from writing to this output_dir at the same time.")
            return self
        os.ftruncate(fd, 0)
        record = {
            "host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
        }
        os.write(fd, (json.dumps(record) + "\n").encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Release the lock (the file stays: removing it could race with a run taking it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _read_owner(fd: int) -> str:
    """The lock file's owner record as ``host H, pid P, started S, command C`` (or what it holds)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode("utf-8", errors="replace").strip()
        owner = json.loads(text)
        return (f"host {owner['host']}, pid {owner['pid']}, started {owner['started']}, "
                f"command {owner['command']!r}")
    except (OSError, ValueError, KeyError, TypeError):
        return "owner not recorded yet"


def check_output_dir(output_dir: str) -> None:
    """Create ``output_dir`` if needed and make sure a file can be written in it.

    Raises:
        ValueError: naming ``output_dir``, its value and the operating system's reason.
    """
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output_dir, prefix=".write_test_"):
            pass
    except OSError as e:
        raise ValueError(
            f"output_dir={output_dir!r} is not writable ({type(e).__name__}: {e.strerror or e}). Metrics and "
            "checkpoints go there: set output_dir to a directory you can write."
        ) from e
