"""One exception type for bad input, reported as a single line without a traceback."""

from __future__ import annotations

import errno
import functools
import os
import sys
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


class UserError(Exception):
    """A problem with what the user asked for (flags, files, data): fixable without reading code."""


# what the machine, not the toolkit, got wrong while writing: said in one line wherever it surfaces
DISK_ERRORS = {errno.ENOSPC: "free space on that disk", errno.EDQUOT: "free space on that disk (the quota is full)",
               errno.EROFS: "choose a folder on a writable file system", errno.EIO: "check the disk"}


def disk_error(e: BaseException | None) -> OSError | None:
    """The OSError of `DISK_ERRORS` behind `e` (itself, or what it was raised from), if any."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in DISK_ERRORS:
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def debug() -> bool:
    """`--debug` (which sets TOOLKIT_DEBUG=1): tracebacks and third-party notices are shown."""
    return os.environ.get("TOOLKIT_DEBUG") == "1"


# seconds the other ranks leave rank 0 to claim an error they all hit
RANK_ZERO_FIRST = 0.5


def first_to_report(line: str) -> bool:
    """Whether this process prints error `line`: always alone; of several ranks on this node, the
    first to claim that line (a file made with O_EXCL, named by the launch and the line), so an
    error every rank hits is one line, not N glued together, while a different error on another
    rank is still said. Rank 0 gets a head start: an error all ranks hit at once is said without a
    rank number."""
    import hashlib
    import tempfile
    import time

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(RANK_ZERO_FIRST)
    launch = "-".join(os.environ.get(k, "")
                      for k in ("TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"))
    said = hashlib.sha256(line.encode()).hexdigest()[:16]
    marker = Path(tempfile.gettempdir()) / f"toolkit-error-{os.getppid()}-{launch}-{said}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    # no writable temp folder: every rank says it
    except OSError:
        return True
    # earlier launches' markers, a day on
    for old in marker.parent.glob("toolkit-error-*"):
        try:
            if time.time() - old.stat().st_mtime > 86400:
                old.unlink()
        # another process swept it first
        except OSError:
            pass
    return True


def exit_on_user_error(prog: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate a CLI main: a `UserError` becomes `prog: error: ...` on stderr and exit status 2.

    `TOOLKIT_DEBUG=1` (or `--debug`, which sets it) re-raises so the traceback is visible.
    """

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def main(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except UserError as e:
                if debug():
                    raise
                line = " ".join(str(e).split())
                if first_to_report(line):
                    rank = int(os.environ.get("RANK", "0"))
                    print(f"{prog}: error: {f'rank {rank}: ' if rank else ''}{line}", file=sys.stderr, flush=True)
                sys.exit(2)
            except Exception as e:  # noqa: BLE001 - only a disk's own errors are turned into a line
                disk = disk_error(e)
                if disk is None or debug():
                    raise
                where = f" {disk.filename}" if disk.filename else ""
                line = f"could not write{where}: {(disk.strerror or str(disk)).lower()}; {DISK_ERRORS[disk.errno]}"
                if first_to_report(line):
                    print(f"{prog}: error: {line}", file=sys.stderr, flush=True)
                sys.exit(2)

        return main

    return wrap
