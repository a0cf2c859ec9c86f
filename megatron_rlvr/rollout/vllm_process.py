"""What an in-process vLLM engine does to its process's global state, and how the engine keeps the actor's intact.

vLLM keeps its parallel state process-global and builds its process groups on torch.distributed's default group; a
CPU engine lives in a trainer rank beside the actor's gloo world. `private_world` gives the engine a one-rank world of
its own while it starts, and `shutdown_keeping_parallel_state` closes an engine without destroying the state (and the
default group) that the actor and the next engine in the process still use.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

# Process-group names vLLM's private groups take (torch names unnamed groups by a per-process counter; see below).
_private_group_count = 1 << 20


@contextlib.contextmanager
def private_world():
    """Let an in-process CPU engine set up its own one-rank torch.distributed world beside the actor's.

    vLLM builds its process groups on top of torch.distributed's default group when one exists; in a trainer rank of
    a multi-rank gloo group (rank 0 holds the engine) that makes vLLM's group creation a collective the other ranks
    never join, and the engine start hangs. With the default group hidden, vLLM initializes a private one-rank world
    (a file store); its groups stay valid after the actor's default group is put back. torch names new groups by a
    per-process counter that must advance alike on every actor rank, so vLLM's groups take numbers from a range of
    their own and the actor's counter is restored. A TP=1 engine runs no collectives, and `close()` destroys no
    process group (see `shutdown_keeping_parallel_state`).
    """
    global _private_group_count
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    actor_world = c10d.GroupMember.WORLD if dist.is_available() and dist.is_initialized() else None
    if actor_world is None:
        yield
        return
    actor_group_count = c10d._world.group_count
    c10d._world.group_count = _private_group_count
    c10d._update_default_pg(None)
    try:
        yield
    finally:
        _private_group_count = c10d._world.group_count
        c10d._world.group_count = actor_group_count
        c10d._update_default_pg(actor_world)


def shutdown_keeping_parallel_state(client: Any) -> None:
    """vLLM's `EngineCore.shutdown()` without its last step, `cleanup_dist_env_and_memory()`.

    That step destroys vLLM's parallel state, which is process-global and shared by every engine in the process
    (closing one engine broke another: "pipeline model parallel group is not initialized", measured), and then
    calls destroy_process_group() on the default group, which beside an actor is the actor's world (on GPU with
    external_launcher always). Kept, the state is reused by the next engine built in this process.
    """
    client._finalizer.detach()  # the in-process client's GC finalizer would otherwise run the full shutdown
    core = client.engine_core
    core.structured_output_manager.clear_backend()
    if core.model_executor:
        core.model_executor.shutdown()
    if core.scheduler:
        core.scheduler.shutdown()
    gc.unfreeze()  # EngineCore froze its start-up objects; unfrozen, the weights and KV cache can be collected
