"""Whether a batch may run on a runner: built for its cache layout and window, by it
(``StepBatch.owner``), each request in the cache block the runner gave it. Another
runner's batch names blocks that hold this runner's requests, and running it would
write over their KV; a stale batch names blocks given since to other requests."""
from __future__ import annotations


def check_runs_here(runner, batch) -> None:
    """Raise a ValueError naming what ties ``batch`` to other blocks than ``runner``'s
    (a ``StepRunner``). A batch that writes no block (a dummy one: every row to the pad
    slot) may come from anywhere with the runner's layout."""
    if batch.layout != runner.layout or batch.window != runner.cfg.window:
        raise ValueError(f"the batch was built for cache layout {batch.layout} and window {batch.window}, "
                         f"this runner has {runner.layout} and window {runner.cfg.window}: build it with "
                         "this runner's build_batch")
    owner = batch.owner
    if owner is not runner and (owner is not None or not batch.pad_writes):  # (a dummy batch writes no block)
        n, size = len(batch.requests), runner.layout.max_model_len
        named = ", ".join(f"request {i} (req_id={batch.requests[i].req_id!r}) in block "
                          f"{batch.view.cache_base[i] // size}" for i in range(min(n, 3)))
        named += f" and {n - 3} more" if n > 3 else ""
        raise ValueError(
            ("the batch was built without an owner (build_step_batch without owner=)" if owner is None else
             f"the batch was built by another runner ({type(owner).__name__} at {id(owner):#x})")
            + f", not by this one ({type(runner).__name__} at {id(runner):#x}): its cache blocks ({named}) are "
            "not the ones this runner gave, and running it would write over the KV of the requests this "
            "runner holds there: build it with this runner's build_batch")
    if not batch.pad_writes:  # each request in the block this runner gave it
        given, bases, size = runner.blocks_given, batch.view.cache_base, runner.layout.max_model_len
        for i, r in enumerate(batch.requests):
            held = given.get(r.req_id)
            if held is None or held * size != bases[i]:
                block = bases[i] // size
                now = [q for q, b in given.items() if b == block]
                raise ValueError(
                    f"request {i} (req_id={r.req_id!r}): the batch writes cache block {block}, but this runner "
                    + ("holds no block for it (freed, or never given one)" if held is None else
                       f"gave the request block {held}")
                    + (f", and block {block} is request {now[0]!r}'s" if now else "")
                    + ": a stale batch, or one not built for these blocks: build it with this runner's "
                      "build_batch")
