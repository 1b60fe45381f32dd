"""Preemption and fault injection.

`Preemption` turns SIGTERM/SIGINT into a flag the loop checks once per step (all ranks agree through
one all-reduce), so the run saves a checkpoint and exits instead of dying mid-step. Work that can be
dropped and redone the same (a user's reward function scoring a round) runs `abandonable()`: a signal
then also ends it at once, however long it would have taken.

`fault_hook()` is how the crash tests kill a run at a chosen point, deterministically:
    TOOLKIT_FAULT="step:5"                 SIGKILL this process after step 5 completes
    TOOLKIT_FAULT="save:4"                 SIGKILL while writing the step-4 checkpoint (weights and
                                           optimizer state written, rank files and trainer_state.json not yet)
    TOOLKIT_FAULT="step:5:rank=1:once=F"   only on rank 1, and only if file F does not exist yet
                                           (created just before the kill: an elastic restart survives)
    TOOLKIT_FAULT="save:4:error=enospc"    raise "No space left on device" in that write instead
    TOOLKIT_FAULT="step:1:error=oom"       raise torch.OutOfMemoryError after step 1, as the CUDA allocator would
    TOOLKIT_FAULT="step:3:signal=term"     SIGTERM instead of SIGKILL: a preemption after step 3 (the run
                                           saves checkpoint-3 and exits 143), to stop a run at a chosen step
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path
from typing import Callable

# 128 + SIGTERM: the run did not finish, a checkpoint was saved
EXIT_PREEMPTED = 143


class Abandoned(BaseException):
    """Raised by the signal handler inside `Preemption.abandonable()`; a BaseException, as KeyboardInterrupt
    is, so that a user's `except Exception` does not swallow it."""


class Abandonable:
    """`with preemption.abandonable():` a signal inside the block ends it there (the handler raises
    `Abandoned`, which the block's end swallows): the caller then finds `preemption.signal` set."""

    def __init__(self, preemption: Preemption):
        self.preemption = preemption

    def __enter__(self) -> None:
        self.preemption.abandoning = True

    def __exit__(self, kind, error, traceback) -> bool:
        self.preemption.abandoning = False
        return kind is Abandoned


class Preemption:
    def __init__(self):
        self.signal: int | None = None
        self.abandoning = False
        self._old = {}
        self._pid = os.getpid()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            # not the main thread (an in-process test): no handler, nothing to restore
            except ValueError:
                pass

    def _handle(self, signum, frame) -> None:
        # a process forked from this one (a data worker) inherits the handler: a flag nobody reads would
        # keep it alive, and its parent's pool waiting on it, so it dies as the signal's default does
        if os.getpid() != self._pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal = signum
        # not inside Abandonable.__exit__ itself: the block has ended, nothing is left to abandon
        if self.abandoning and frame is not None and frame.f_code is not Abandonable.__exit__.__code__:
            self.abandoning = False
            raise Abandoned

    def abandonable(self) -> Abandonable:
        """A block a signal ends at once (`Abandonable`)."""
        return Abandonable(self)

    def requested(self, accelerator) -> bool:
        """True on every rank once any rank got the signal (collective when there are several). The ranks
        agree over a CPU group (`host_group`), so asking every step never waits for the GPU."""
        if accelerator.num_processes == 1:
            return self.signal is not None
        import torch
        import torch.distributed as dist

        from toolkit.parallel import host_group

        flag = torch.tensor([float(self.signal is not None)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_group())
        return flag.item() > 0

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def fault_hook() -> Callable[[str, int], None] | None:
    spec = os.environ.get("TOOLKIT_FAULT")
    if not spec:
        return None
    where, at, *opts = spec.split(":")
    options = dict(o.split("=", 1) for o in opts)
    rank = int(options.get("rank", 0))
    once = options.get("once")

    def fire(point: str, step: int) -> None:
        if point != where or step != int(at) or int(os.environ.get("RANK", 0)) != rank:
            return
        if once:
            if Path(once).exists():
                return
            Path(once).touch()
        if options.get("error") == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if options.get("error") == "oom":
            import torch

            raise torch.OutOfMemoryError(f"CUDA out of memory (TOOLKIT_FAULT={spec})")
        os.kill(os.getpid(), signal.SIGTERM if options.get("signal") == "term" else signal.SIGKILL)

    return fire
