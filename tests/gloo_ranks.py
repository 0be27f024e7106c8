"""Spawned gloo ranks for tests that need torch.distributed alone (no Megatron parallel state:
``mcore_hooks.testing.run_on_ranks`` is the Megatron one). Imports torch only: CI also runs
``test_kernels_alone.py`` in a venv without Megatron Core."""

from __future__ import annotations

import datetime
import importlib
import os
import queue as queue_module
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(module: str, name: str, rank: int, world: int, port: int, timeout: float,
            results: Any, environ: dict) -> None:
    os.environ.clear()  # the caller's, as a spawned rank has it (not the fork server's)
    os.environ.update(environ)
    reported = False
    try:
        torch.set_num_threads(1)  # the ranks share a small CPU box
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        try:
            fn = getattr(importlib.import_module(module), name)
            try:
                message = (rank, "ok", fn(rank, world))
            except BaseException:  # noqa: BLE001 - every failure must reach the parent
                message = (rank, "err", traceback.format_exc())
            results.put(message)
            reported = True
            if message[1] == "ok":
                dist.barrier()  # no rank tears down while another is still in a collective
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent raises it with this rank's traceback
        if not reported:
            results.put((rank, "err", traceback.format_exc()))


def _context():
    """Fresh processes, forked from a fork server that imported torch once (each spawned rank
    would import it again: seconds of CPU each); spawned where there is no fork server. The
    server is one per process: it preloads what run_on_ranks' ranks need too (Megatron Core
    where it is installed; where not, torch alone), whichever of the two starts it."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["mcore_hooks.testing._rank_preload"])
    return ctx


def run_gloo_ranks(fn: Callable[[int, int], Any], world: int, timeout: float = 240.0) -> list:
    """``fn(rank, world)`` on ``world`` spawned gloo ranks (``fn`` a module-level function; what it
    returns travels by pickle: lists and floats, not tensors, whose shared memory the rank
    frees when it exits); the results in rank order.

    A rank that raises, or dies before reporting, fails the call. Once every rank has reported,
    how its process exits is not checked: gloo's teardown at interpreter exit sometimes aborts
    ("terminate called without an active exception", seen in CI) after the results are in."""
    ctx = _context()
    results = ctx.Queue()
    # the group's store served from here, on a port the system picks: no probe to race
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_worker, args=(fn.__module__, fn.__name__, r, world, port, timeout, results,
                                               dict(os.environ)),
                         daemon=True) for r in range(world)]
    outputs: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(outputs) < world:  # a rank that dies or hangs fails the test, never hangs it
            try:
                rank, status, data = results.get(timeout=2)
            except queue_module.Empty:
                silent = [r for r, p in enumerate(procs) if r not in outputs and not p.is_alive()]
                if silent:  # a report sent just before exiting may still be in flight
                    try:
                        rank, status, data = results.get(timeout=2)
                    except queue_module.Empty:
                        raise AssertionError(f"ranks {silent} died without reporting "
                                             f"(exit codes {[procs[r].exitcode for r in silent]})")
                else:
                    assert time.monotonic() < deadline, f"the ranks did not answer within {timeout} s"
                    continue
            assert status == "ok", f"rank {rank} raised:\n{data}"
            outputs[rank] = data
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return [outputs[r] for r in range(world)]
