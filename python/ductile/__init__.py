"""ductile's helpers for scripts run as ``runtime = "torchrun"``, ``"torchft"`` or ``"tf"`` jobs.

The script's launcher (``ductile-worker launch``) listens on a Unix datagram socket named by
``DUCTILE_CONTROL`` and creates the file named by ``DUCTILE_PREEMPT_FILE`` when a planned
drain is coming. Outside ductile neither is set and every call is a no-op. Standard library only.
"""

import json
import os
import socket
import time

__version__ = "0.1.0"
__all__ = ["report", "saved", "preempted", "checkpoint_url", "in_ductile"]

_sock = None


def in_ductile():
    """Whether this process runs under a ductile launcher."""
    return bool(os.environ.get("DUCTILE_CONTROL"))


def report(step, loss=None, samples=None):
    """Tell ductile this rank finished ``step`` (the job's progress comes from rank 0's).

    ``loss``: the step's loss (a float); ``samples``: the samples the step took over all ranks
    (for the rate). Never blocks and never raises: a report the launcher cannot take is lost,
    the next one replaces it.
    """
    msg = {"step": int(step), "t": time.time()}
    if loss is not None:
        msg["loss"] = float(loss)
    if samples is not None:
        msg["samples"] = float(samples)
    _send(msg)


def _send(msg):
    """One datagram to the launcher; lost (never raised) when it cannot take it."""
    global _sock
    path = os.environ.get("DUCTILE_CONTROL")
    if not path:
        return
    try:
        if _sock is None:
            _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _sock.setblocking(False)
        _sock.sendto(json.dumps(msg).encode(), path)
    except OSError:
        pass


def saved(step):
    """Tell ductile this job saved its checkpoint at ``step`` (rank 0, after the save is
    complete): a resize or drain waiting for the notice's save goes ahead at once instead of
    after ``drain_notice_s``. Never blocks and never raises."""
    _send({"step": int(step), "saved": True, "t": time.time()})


def preempted():
    """True once a planned change will stop this world (a drain, a spot notice, a resize of a
    torchrun job): save now (then :func:`saved`), SIGTERM follows."""
    path = os.environ.get("DUCTILE_PREEMPT_FILE")
    return bool(path) and os.path.exists(path)


def checkpoint_url():
    """The job's ``[checkpoint] url``, or None."""
    return os.environ.get("DUCTILE_CHECKPOINT_URL") or None
