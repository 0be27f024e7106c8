"""Where a tensor-parallel forward's time goes: the log-prob pass on each rank's vocabulary shard,
with and without the group, all ranks at once (NCCL, one rank per GPU).

    python benchmarks/profile_tp.py --tp 2 4 [--shape 16384 4096 151936] [--iters 10]

For each TP degree, each rank's median ms of ``linear_logprob_entropy`` forwards (no grad):

- ``shard alone``: the shard's pass with no group (every rank at once, so the GPUs share the
  node's power and the host as in the TP run; its result is not the model's);
- ``TP`` / ``TP + SP``: the pass over the group (the statistics gathered and combined; under SP
  the hidden states all-gathered first);
- each timed two ways: calls back to back (``bench_tp.py``'s way: a rank's skew carries into
  the next call's collective) and each call after a barrier and a sync (no carried skew).

Then torch's sync debug mode over one TP and one TP + SP call (any operation that waits on the
device), and one profile (``torch.profiler``, CUDA activity, after warm-up steps so that the
ranks' profilers all run) of five TP forwards on every rank: the GPU's time a call by kernel,
and summed (busy time, to set beside the call's time above; a collective's wait for a slower
rank counts as busy). ``bench_tp.py`` gives the comparison with stock and Liger.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import warnings

import torch
import torch.distributed as dist

import bench_tp


def _median_ms(call, iters: int, synced: bool, group) -> float:
    """This rank's median ms of ``call`` between CUDA events: back to back (``bench_tp.timed``:
    one sync at the end, so a rank's skew carries into the next call's collective) or each call
    after a barrier and a sync (the host's work before the first kernel is then in the time)."""
    if not synced:
        return bench_tp.timed(call, iters, 3)
    for _ in range(3):
        call()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, shape, iters: int) -> None:
    from mcore_hooks.kernels import VocabParallel, linear_logprob_entropy

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    vl = shape[2] // world
    x, w, y = bench_tp.inputs(shape, torch.device("cuda", rank))  # the whole problem, as bench_tp's
    y = y % (vl * world)  # the shards cover world * vl rows: the labels stay among them
    w = w[rank * vl:(rank + 1) * vl].contiguous()
    xs = x.chunk(world)[rank].contiguous()
    # the shard alone: its own labels in range (the pass refuses ids past the shard)
    y_local = y % vl
    paths = {
        "shard alone": lambda: linear_logprob_entropy(x, w, y_local),
        "TP": lambda: linear_logprob_entropy(x, w, y, parallel=VocabParallel(group, rank * vl, False)),
        "TP + SP": lambda: linear_logprob_entropy(xs, w, y, parallel=VocabParallel(group, rank * vl, True)),
    }
    rows = []
    with torch.no_grad():
        for name, call in paths.items():
            for synced in (False, True):
                ms = _median_ms(call, iters, synced, group)
                out = [torch.zeros(1, dtype=torch.float64, device="cuda") for _ in range(world)]
                dist.all_gather(out, torch.tensor([ms], dtype=torch.float64, device="cuda"), group=group)
                rows.append((name, synced, [round(t.item(), 3) for t in out]))
        # what in a TP call waits on the device (an item(), a copy to the host), as torch sees it
        syncs = {}
        for name in ("TP", "TP + SP"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    paths[name]()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            # torch's own note that the mode is a prototype is not a synchronisation
            syncs[name] = [str(w.message).splitlines()[0][:120] for w in caught
                           if "called a synchronizing" in str(w.message)]
        dist.barrier(group=group)
        torch.cuda.synchronize()
        # wait and warm-up steps first: the ranks' profilers start at different times, and a
        # collective issued before the last one runs would count that wait as busy
        schedule = torch.profiler.schedule(wait=2, warmup=2, active=5)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                    schedule=schedule) as prof:
            for _ in range(9):
                paths["TP"]()
                prof.step()
            torch.cuda.synchronize()
    if rank == 0:
        print(f"=== TP {world}, {shape}, forward (no grad), ms a call on each rank (median of {iters})")
        for name, synced, ms in rows:
            print(f"  {name:12s} {'after a barrier' if synced else 'back to back  '}: {ms}")
        for name, found in syncs.items():
            print(f"  {name}: {len(found)} synchronizing CUDA call(s) in a call" + "".join(f"\n    {m}" for m in found))
    for r in range(world):
        dist.barrier(group=group)
        if r == rank:
            events = [e for e in prof.key_averages() if e.device_time_total > 0]
            events.sort(key=lambda e: -e.device_time_total)
            busy = sum(e.device_time_total for e in events) / 5 / 1e3
            print(f"--- TP {world}, rank {rank}: GPU busy {busy:.3f} ms a TP call (5 calls profiled)")
            for e in events[:8]:
                print(f"    {e.device_time_total / 5 / 1e3:8.3f} ms  x{e.count // 5:<3d} {e.key[:90]}")
    dist.barrier(group=group)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--shape", type=int, nargs=3, default=[16384, 4096, 151936])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if any(args.shape[0] % world for world in args.tp):
        ap.error("--shape: the tokens must divide by every TP degree (sequence parallelism)")
    import torch.multiprocessing as mp

    for world in args.tp:
        if world > torch.cuda.device_count():
            print(f"TP {world}: only {torch.cuda.device_count()} GPUs")
            continue
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_worker, args=(world, port, tuple(args.shape), args.iters), nprocs=world, join=True)


if __name__ == "__main__":
    main()
