"""``mcore-hooks verify``: the bundled processors against the stock model, as a table."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Optional, Sequence


def _verify_rank(device: str, model_classes: Optional[list]) -> list:
    from .verify import run_checks

    return run_checks(device=device, model_classes=model_classes)


def verify(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mcore-hooks verify",
        description="Build a tiny model of each supported class on the installed Megatron Core, run "
        "every bundled processor through the hook and the stock path, and compare values and "
        "gradients. Exit status 1 on any mismatch.",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--tp", type=int, nargs="+", default=[1, 2], metavar="N",
        help="tensor-parallel sizes to check; N > 1 spawns N ranks (default: 1 2)",
    )
    parser.add_argument(
        "--model", nargs="+", default=None, choices=["gpt", "hybrid", "mamba"],
        help="model classes to check (default: every class the installed release has)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.tp):
        parser.error("--tp: expected positive integers")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device: expected cpu or cuda, got {args.device!r}")
    warnings.filterwarnings("ignore")  # Megatron's import-time notes about TE/Apex drown the table

    import megatron.core
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available")

    from .testing import available_model_classes, model_parallel, run_on_ranks
    from .verify import format_table, merge_ranks, to_json

    classes = args.model or list(available_model_classes())
    missing = sorted(set(classes) - set(available_model_classes()))
    if missing:
        parser.error(f"--model: not in Megatron Core {megatron.core.__version__}: {', '.join(missing)}")
    results = []
    for tp in args.tp:
        if tp == 1:
            with model_parallel(tp=1):
                results += _verify_rank(args.device, classes)
        else:
            results += merge_ranks(run_on_ranks(_verify_rank, tp, args.device, classes))
    ok = all(r.passed for r in results)
    meta = dict(megatron_core=megatron.core.__version__, torch=torch.__version__, device=args.device)
    if args.json:
        print(to_json(results, **meta))
    else:
        print(f"mcore-hooks verify: Megatron Core {meta['megatron_core']}, torch {meta['torch']}, "
              f"device {args.device}")
        print(format_table(results))
        print(f"{sum(r.passed for r in results)} passed, {sum(not r.passed for r in results)} failed")
    return 0 if ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mcore-hooks verify [--device cpu|cuda] [--tp N ...] [--model ...] [--json]")
        return 0 if argv else 2
    if argv[0] != "verify":
        print(f"mcore-hooks: unknown command {argv[0]!r}; the command is `verify`", file=sys.stderr)
        return 2
    return verify(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
