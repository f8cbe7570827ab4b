"""What every pool of simulation workers shares (a sweep's points and bands, `sim capacity`'s searches, `sim run
--interval`'s runs): each worker ends with the command and leaves Ctrl-C to it, says its warnings through the process
that reports, and is stopped at once when the command stops."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def tie_to_parent(parent: int) -> None:
    """Make this worker end with the command's process: a worker outliving it (killed by SIGKILL, or an OOM kill)
    would wait forever for work on a queue nobody closes, holding a core."""
    # Ctrl-C reaches the whole process group; it is the parent's to handle (keep what finished, stop the workers),
    # and a worker interrupted mid-point would only print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above took hold
        os._exit(1)


def recording_warnings(fn, *args) -> tuple[object, list[str]]:
    """fn(*args) and the messages of every warning it raised: a worker's are said by the process that reports."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    return result, [str(w.message) for w in caught]


def stop(pool: ProcessPoolExecutor) -> None:
    """End the workers now, mid-point: on Ctrl-C or a failed point nothing they would still finish is wanted."""
    workers = list((pool._processes or {}).values())  # no public handle on them before Python 3.14's kill_workers
    pool.shutdown(wait=False, cancel_futures=True)
    for w in workers:
        w.kill()
    for w in workers:
        w.join()
