"""One gloo transport device per worker process, shared by every gloo process group it creates.

Why: torch gives each gloo process group a device of its own, and each device runs an event-loop thread
(`gloo_tcp_loop`) that wakes every 10 ms (`epoll_wait` with a 10 ms timeout), busy or not. megatron-core creates
~35 groups per layout (TP, PP, DP, CP, EP, their products, the embedding groups...), and a long-lived test worker
holds every group it ever made (35 to 180 of them over the suite): idle, such a worker woke thousands of times a
second, 1-6% of a core per process (70 groups: 3.6% on an otherwise idle machine), taken from the tests running
meanwhile. With one shared device a process has one such thread, whatever its number of groups: 0.1% idle.

gloo's TCP device is made to be shared: its listener matches every incoming connection to a pair by a sequence
number of its own, whichever context the pair belongs to. Only the groups' device changes; their ranks, timeouts and
worker threads (2 each, as torch gives them) stay, so collectives are the same calls on the same data.
"""

from __future__ import annotations

import datetime
from typing import Any

_DEFAULT_TIMEOUT = datetime.timedelta(seconds=1800)  # torch's own default for a ProcessGroupGloo made without one


def share_one_gloo_device() -> None:
    """From now on every `ProcessGroupGloo` this process makes without explicit options uses one shared device.

    Call it before `torch.distributed.init_process_group`, so that the world group shares it too. Idempotent."""
    from torch.distributed import ProcessGroupGloo

    if getattr(ProcessGroupGloo.__init__, "_shares_one_device", False):
        return
    make = ProcessGroupGloo.__init__
    devices: list[Any] = []

    def init(self, store, rank, size, timeout=_DEFAULT_TIMEOUT):
        if isinstance(timeout, ProcessGroupGloo._Options):  # explicit options: the caller chose its devices
            return make(self, store, rank, size, timeout)
        if not devices:
            devices.append(ProcessGroupGloo.create_default_device())
        options = ProcessGroupGloo._Options()
        options._devices = devices
        options._threads = 2 * len(devices)  # what torch gives a group of one device
        options._timeout = timeout
        return make(self, store, rank, size, options)

    init._shares_one_device = True
    ProcessGroupGloo.__init__ = init
