"""``mcore-hooks``: the command line. ``mcore-hooks verify`` checks the bundled processors against
stock Megatron Core on tiny models and prints a table (or JSON)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from typing import Optional, Sequence

DESCRIPTION = """\
mcore-hooks gives Megatron Core language models (GPTModel, HybridModel, MambaModel) upstream's
keyword-only output_processor hook on every supported release, with fused processors for
selected-token log-probabilities, entropy and linear cross-entropy that never build
[tokens, vocab] logits.

`mcore-hooks verify` builds tiny models of each class the installed Megatron Core has, runs every
bundled processor (and, on GPTModel, the verl and NeMo RL integrations') through the hook and the
stock path side by side, and compares values and gradients: float32 models against stock
(bitwise or to float32 rounding), bf16 models against float64 (at least as accurate as stock;
gradients up to one bf16 rounding of the result). It reports its progress on stderr, names every
processor it checked, and exits with status 1 on any mismatch.
"""


def _progress(line: str) -> None:
    """One line of progress on stderr, at once (stdout keeps the report: ``--json`` stays JSON);
    from rank 0 only where the checks run on several ranks."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_rank() != 0:
            return
        if dist.get_world_size() > 1:
            line = f"{line} (rank 0 of {dist.get_world_size()})"
    print(f"mcore-hooks verify: {line}", file=sys.stderr, flush=True)


def _verify_rank(device: str, model_classes: Optional[list]) -> list:
    from .verify import run_checks

    return run_checks(device=device, model_classes=model_classes, progress=_progress)


def _megatron_core_version() -> str:
    # From the installed distribution: Megatron's own package_info appends the git commit of
    # whatever repository the process runs in.
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        import megatron.core

        return megatron.core.__version__


def _version() -> str:
    from . import __version__
    from ._quiet import quiet_megatron

    try:
        with quiet_megatron():  # the import's notes, where there is no distribution to read
            mcore = _megatron_core_version()
    except ImportError:
        mcore = "not installed"
    return f"mcore-hooks {__version__} (Megatron Core {mcore})"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Lists each command once, under "commands:": argparse's own listing puts the subparsers'
    metavar (or ``{verify}``) on a line of its own above the commands, a second ``verify``."""

    def _format_action(self, action: argparse.Action) -> str:
        if isinstance(action, argparse._SubParsersAction):
            return "".join(self._format_action(sub) for sub in action._get_subactions())
        return super()._format_action(action)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcore-hooks", description=DESCRIPTION, formatter_class=_HelpFormatter
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(title="commands", dest="command", metavar="command", required=True)
    verify = commands.add_parser(
        "verify",
        help="check every bundled processor against stock Megatron Core on tiny models",
        description="Build a tiny model of each supported class on the installed Megatron Core, "
        "run every bundled processor (and, on GPTModel, the verl and NeMo RL integrations') "
        "through the hook and the stock path, and compare values and gradients (float32 models "
        "against stock, bf16 models against float64). Progress on stderr, one line a class and "
        "group; the report on stdout. Exit status 1 on any mismatch.",
    )
    verify.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    verify.add_argument(
        "--tp", type=int, nargs="+", default=[1, 2], metavar="N",
        help="tensor-parallel sizes to check; N > 1 spawns N ranks (default: 1 2)",
    )
    verify.add_argument(
        "--model", nargs="+", default=None, choices=["gpt", "hybrid", "mamba"],
        help="model classes to check (default: every class the installed release has)",
    )
    verify.add_argument("--table", action="store_true",
                        help="print every check's row (default: the verdict and any failing rows)")
    verify.add_argument("--json", action="store_true", help="print every check as JSON")
    verify.set_defaults(subparser=verify)  # its own usage in its errors
    return parser


def verify(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[int, str]:
    """Run the checks; returns the exit status and the report to print (the verdict first, then
    any failing rows; every row with ``--table``). ``parser``: verify's own, for its errors."""
    if any(n < 1 for n in args.tp):
        parser.error("--tp: expected positive integers")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device: expected cpu, cuda or cuda:N, got {args.device!r}")
    from ._quiet import quiet_megatron  # before anything imports Megatron Core

    with quiet_megatron():
        import torch

        if args.device != "cpu" and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: no CUDA device is available")
        from .testing import TinyModelConfig, available_model_classes, model_parallel, run_on_ranks
        from .verify import format_table, merge_ranks, to_json

        tiny = TinyModelConfig()
        uneven = [n for n in args.tp if not tiny.splits_over(n)]
        if uneven:
            parser.error(
                f"--tp {' '.join(map(str, uneven))}: the tiny models' {tiny.num_attention_heads} "
                f"attention heads and {tiny.vocab_size}-token vocabulary split evenly over 1, 2 or 4 "
                "ranks only"
            )

        version = _megatron_core_version()
        classes = args.model or list(available_model_classes())
        missing = sorted(set(classes) - set(available_model_classes()))
        if missing:
            why = " (HybridModel arrived in Megatron Core 0.18)" if "hybrid" in missing else ""
            parser.error(f"--model: not in Megatron Core {version}: {', '.join(missing)}{why}")
        from .verify import PRECISION_CHECKS, PROCESSOR_CHECKS, processor_names

        n = len(processor_names(c.name for c in PROCESSOR_CHECKS + PRECISION_CHECKS
                                if c.models is None or set(c.models) & set(classes)))
        print(f"mcore-hooks verify: {n} processors on {', '.join(classes)} at TP "
              f"{', '.join(map(str, args.tp))}, float32 against stock and bf16 against float64; one "
              "line a class and group as they finish", file=sys.stderr, flush=True)
        results = []
        for tp in args.tp:
            if tp == 1:
                with model_parallel(tp=1):
                    results += _verify_rank(args.device, classes)
            else:
                results += merge_ranks(run_on_ranks(_verify_rank, tp, args.device, classes))
    status = 0 if all(r.passed for r in results) else 1
    meta = dict(megatron_core=version, torch=torch.__version__, device=args.device)
    if args.json:
        return status, to_json(results, **meta, processors=processor_names(r.processor for r in results))
    failed = [r for r in results if not r.passed]
    lines = [
        f"mcore-hooks verify: Megatron Core {version}, torch {meta['torch']}, device {args.device}",
        f"{len(results) - len(failed)} passed, {len(failed)} failed",
        _coverage(results, args.tp),
        _checked(results),
    ]
    if args.table:
        lines += ["", format_table(results)]
    elif failed:
        lines += ["", "failing checks:", format_table(failed)]
    if not args.table:
        lines.append("(every check's row: mcore-hooks verify --table; as JSON: --json)")
    return status, "\n".join(lines)


def _coverage(results: list, tps: list) -> str:
    """What the checks covered, in one line: model classes, TP degrees, layouts."""
    models = sorted({r.model for r in results})
    layouts = {part for r in results for part in r.layout.split()[1:]}
    return (f"covered: {', '.join(models)} at TP {', '.join(map(str, tps))}, float32 and bf16, "
            f"{' and '.join(sorted(layouts & {'packed', 'tied', 'untied'}))} outputs; every "
            "processor through the hook, values and gradients against the stock path (float32) or "
            "float64 (bf16)")


def _checked(results: list) -> str:
    """Every processor the checks ran, by name, in one line; those run on some classes only
    (the integrations: verl and NeMo RL run GPTModel) say which, and why."""
    from .verify import processor_names

    models = sorted({r.model for r in results})
    names, some = [], False
    for name in processor_names(r.processor for r in results):
        on = sorted({r.model for r in results if r.processor.split(",")[0] == name})
        some = some or on != models
        names.append(name if on == models else f"{name} ({' and '.join(on)} only)")
    why = "; the integrations on gpt only: verl and NeMo RL run GPTModel" if some else ""
    return f"processors checked ({len(names)}): {', '.join(names)}{why}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    command = getattr(args, "subparser", parser)
    if unknown:  # reported by the command they were given to, with its usage
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    status, report = verify(args, command)
    try:
        print(report)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`mcore-hooks verify --json | head`): stop quietly, as Unix tools
        # do, keeping the checks' status; stdout goes to devnull so the final flush cannot raise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return status


if __name__ == "__main__":
    sys.exit(main())
