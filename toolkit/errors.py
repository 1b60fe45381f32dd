"""One exception type for bad input, reported as a single line without a traceback."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, TypeVar

T = TypeVar("T")


class UserError(Exception):
    """A problem with what the user asked for (flags, files, data): fixable without reading code."""


def debug() -> bool:
    """`--debug` (which sets TOOLKIT_DEBUG=1): tracebacks and third-party notices are shown."""
    return os.environ.get("TOOLKIT_DEBUG") == "1"


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
                print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
                sys.exit(2)

        return main

    return wrap
