"""Run test code under Megatron Core model parallelism on CPU (gloo).

- :func:`model_parallel`: a context manager initialising Megatron's parallel state in the current
  process (creating a single-rank gloo process group when none exists), so single-rank tests
  avoid the cost of spawning processes.
- :func:`run_on_ranks`: spawns one process per rank, runs a picklable module-level function
  under :func:`model_parallel` in each and returns the per-rank results in rank order.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from .shims import cpu_shims
from .._quiet import call_quietly, quiet_megatron

__all__ = ["DEFAULT_SEED", "model_parallel", "run_on_ranks"]

#: Seed given to ``torch.manual_seed`` and ``model_parallel_cuda_manual_seed`` by the helpers.
DEFAULT_SEED = 1234


def _initialize_model_parallel(tp: int, cp: int) -> None:
    from megatron.core import parallel_state

    kwargs: dict[str, Any] = {"tensor_model_parallel_size": tp, "context_parallel_size": cp}
    params = inspect.signature(parallel_state.initialize_model_parallel).parameters
    # Gloo "side" groups are only needed by the distributed optimizer; skip them where the
    # version lets us (fewer groups, faster set-up). All groups use the default (gloo) backend.
    if "create_gloo_process_groups" in params:
        kwargs["create_gloo_process_groups"] = False
    parallel_state.initialize_model_parallel(**kwargs)


@contextlib.contextmanager
def model_parallel(tp: int = 1, cp: int = 1, *, seed: int = DEFAULT_SEED) -> Iterator[None]:
    """Initialise Megatron Core's model-parallel state for the body, then destroy it.

    Re-entrant: when the state already exists with the same ``tp``/``cp`` it is reused (only
    torch is re-seeded) and left for its owner to destroy; other sizes raise ``RuntimeError``.

    With no process group yet, creates a single-rank gloo group (so only
    ``tp * cp == 1`` works) and destroys it on exit; otherwise uses the existing group, whose
    world size must be a multiple of ``tp * cp`` (the rest is data parallel). The body runs inside
    a :func:`~mcore_hooks.testing.cpu_shims` scope (everything it patches is put back on exit),
    with torch seeded with ``seed`` and Megatron's RNG tracker seeded
    (``model_parallel_cuda_manual_seed``).
    """
    from megatron.core import parallel_state, tensor_parallel

    if tp < 1 or cp < 1:
        raise ValueError(f"tp and cp must be >= 1, got tp={tp}, cp={cp}")
    if parallel_state.model_parallel_is_initialized():
        # Nested use (e.g. a module fixture inside a session fixture): reuse the state when the
        # sizes match, leave its teardown to the outer owner.
        sizes = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
        )
        if sizes != (tp, cp):
            raise RuntimeError(
                f"Megatron model parallel state is already initialised with (tp, cp) = {sizes}, "
                f"not {(tp, cp)}"
            )
        with cpu_shims():
            torch.manual_seed(seed)
            yield
        return
    created_group = False
    if not dist.is_initialized():
        if tp * cp != 1:
            raise ValueError(
                f"model_parallel(tp={tp}, cp={cp}) needs {tp * cp} ranks; this process has no "
                "process group: use run_on_ranks to spawn them"
            )
        # an in-process store: no port to find, none another process could take
        dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
        created_group = True
    elif dist.get_world_size() % (tp * cp) != 0:
        raise ValueError(
            f"world size {dist.get_world_size()} is not a multiple of tp*cp = {tp * cp}"
        )
    try:
        with cpu_shims():
            _initialize_model_parallel(tp, cp)
            try:
                torch.manual_seed(seed)
                tensor_parallel.model_parallel_cuda_manual_seed(seed)
                yield
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        if created_group:
            dist.destroy_process_group()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    tp: int,
    cp: int,
    timeout: float,
    payload: bytes,
    results: Any,
    environ: Optional[dict] = None,
) -> None:
    """Body of one spawned rank: puts (rank, 'ok', pickled result) or (rank, 'err', traceback).
    ``environ``: the caller's environment, as a spawned process would have it (a rank forked from
    the fork server starts with the server's)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    reported = False
    try:
        with quiet_megatron():  # Megatron's notes about itself, per rank, say nothing here
            # Ranks share a small CPU box: one thread each avoids oversubscription.
            torch.set_num_threads(1)
            fn, args, kwargs = pickle.loads(payload)
            # the parent's store: it listens on a port the system gave it, so no free-port probe
            # can race another process (test runs side by side) for it
            store = dist.TCPStore("127.0.0.1", port, None, False,
                                  timeout=datetime.timedelta(seconds=timeout))
            dist.init_process_group(
                backend="gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
            try:
                with model_parallel(tp=tp, cp=cp):
                    # Report before any teardown: once this rank leaves the group, ranks still in
                    # a collective fail too, and their error must not arrive first.
                    try:
                        message = (rank, "ok", pickle.dumps(fn(*args, **kwargs)))
                    except BaseException:  # noqa: BLE001 - every failure must reach the parent
                        message = (rank, "err", traceback.format_exc())
                    results.put(message)
                    reported = True
            finally:
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent re-raises it with this rank's traceback
        if not reported:
            results.put((rank, "err", traceback.format_exc()))


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tp: Optional[int] = None,
    cp: int = 1,
    timeout: float = 300,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned CPU ranks; return results by rank.

    Each rank joins a gloo process group on 127.0.0.1 (its store served by this process on a port
    the system picks), initialises Megatron's model
    parallel state with ``tensor_model_parallel_size=tp or world_size`` and
    ``context_parallel_size=cp`` (see :func:`model_parallel`: CPU shims installed, torch and the
    RNG tracker seeded with :data:`DEFAULT_SEED`), runs ``fn`` and tears everything down. ``fn``
    must be a module-level (picklable) function and its result picklable.

    If a rank raises, the others are killed and a ``RuntimeError`` carrying that rank's full
    traceback is raised. After ``timeout`` seconds all ranks are killed and a ``RuntimeError``
    saying which ranks did not finish is raised: it never hangs.
    """
    tp = world_size if tp is None else tp
    if world_size < 1 or world_size % (tp * cp) != 0:
        raise ValueError(f"world_size={world_size} is not a positive multiple of tp*cp={tp * cp}")
    payload = pickle.dumps((fn, args, kwargs))  # fail here, not in a child, if unpicklable
    return _run_once(fn, world_size, tp, cp, timeout, payload)


def _rank_context():
    """How ranks start: as spawned processes (a fresh interpreter each, so nothing of this
    process's state leaks in), but forked from a fork server that imported torch and Megatron
    Core once (:mod:`._rank_preload`), not each importing them anew. Spawned where the platform
    has no fork server, or where CUDA is available (a process forked after CUDA's driver
    started cannot use it: ranks may run on the GPU there). Unlike spawned ones, the ranks write
    to the stdout and stderr this process had when the server started (its first call), and
    settings torch and Megatron Core read from the environment at import are those of that
    moment (the rest of the environment is the caller's, at each call); the server is this
    process's one (``multiprocessing``'s ``forkserver`` context, its preload set here)."""
    import multiprocessing

    import torch.multiprocessing as mp

    if "forkserver" not in multiprocessing.get_all_start_methods() or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([f"{__package__}._rank_preload"])
    return ctx


def _run_once(fn: Callable[..., Any], world_size: int, tp: int, cp: int, timeout: float,
              payload: bytes) -> list[Any]:
    ctx = _rank_context()
    results = ctx.Queue()
    # the group's store, served from here until the ranks are gone
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    port = store.port
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=call_quietly,  # by name: the child imports Megatron Core only once quiet
            args=(__name__, "_worker", rank, world_size, port, tp, cp, timeout, payload, results,
                  environ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
    except EOFError as e:  # the fork server died: its preload raised (not an ImportError)
        raise RuntimeError(
            "run_on_ranks: the fork server its ranks start from failed while importing torch and "
            "Megatron Core (mcore_hooks.testing._rank_preload); run `python -c 'import "
            "megatron.core.models.gpt'` to see why") from e
    deadline = time.monotonic() + timeout
    outputs: dict[int, Any] = {}
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"run_on_ranks({getattr(fn, '__name__', fn)!r}): ranks "
                    f"{sorted(set(range(world_size)) - set(outputs))} did not finish in "
                    f"{timeout} s; killed"
                )
            try:
                rank, status, data = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit, OOM kill) would
                # otherwise leave us waiting for the timeout.
                dead = _dead_silent_ranks(procs, outputs)
                if dead:
                    try:  # a report sent just before exiting may still be in flight
                        rank, status, data = results.get(timeout=1.0)
                    except queue.Empty:
                        raise RuntimeError(
                            f"run_on_ranks: {_describe_dead(procs, dead)} of {world_size} died "
                            "without reporting a result"
                        ) from None
                else:
                    continue
            if status == "err":
                note = ""
                time.sleep(0.2)  # let a rank whose death caused this error be seen as dead
                dead = [r for r in _dead_silent_ranks(procs, outputs) if r != rank]
                if dead:
                    note = f"\n(also: {_describe_dead(procs, dead)} died without reporting)"
                raise RuntimeError(f"rank {rank} of {world_size} raised:\n{data}{note}")
            outputs[rank] = pickle.loads(data)
        for proc in procs:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5)
        results.close()
    return [outputs[rank] for rank in range(world_size)]


def _dead_silent_ranks(procs: list, outputs: dict[int, Any]) -> list[int]:
    return [
        rank
        for rank, proc in enumerate(procs)
        if rank not in outputs and not proc.is_alive() and proc.exitcode not in (0, None)
    ]


def _describe_dead(procs: list, ranks: list[int]) -> str:
    return ", ".join(f"rank {rank} (exit code {procs[rank].exitcode})" for rank in ranks)
