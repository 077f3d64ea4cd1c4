"""The ``pagedkv`` command. Each subcommand lives beside the code it drives and is imported lazily,
so ``pagedkv simulate`` never loads torch.

Subcommands register here as ``name -> "module:function"``; each function takes the remaining
argv and returns an exit code. Exit codes, one convention for every command: 0 success, 1 a
failure while running (a model that cannot load, a port in use, a missing optional module),
2 bad usage (argparse's code: an unknown command or flag, a bad flag value). Errors go to stderr.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

from pagedkv.errors import PagedKVError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("pagedkv.sim.cli:main", "replay a workload through the scheduler and cache"),
    "plan": ("pagedkv.sim.plan_cli:main", "find the highest request rate meeting latency SLOs"),
    "profile": ("pagedkv.engine.profile_cli:main", "measure engine steps for simulate --profile"),
    "bench-core": ("pagedkv.core.bench_cli:main", "run the core benchmarks (benchmarks/)"),
    "demo": ("pagedkv.engine.demo:demo_main", "run a real chat model end to end (--tiny: random)"),
    "generate": (
        "pagedkv.engine.cli:generate_main",
        "generate text from a model (folder or GGUF)",
    ),
    "serve": ("pagedkv.server.cli:main", "serve an OpenAI-compatible API"),
    "router": ("pagedkv.router.cli:main", "route requests over several engines by KV cache"),
}
# The commands that run a model: started as a process, they re-execute themselves once with
# glibc's huge-page tunable (pagedkv.engine.host_alloc; PAGEDKV_HUGE_PAGES=0 opts out).
MODEL_COMMANDS = frozenset({"demo", "generate", "profile", "serve"})


def _usage() -> str:
    lines = ["usage: pagedkv [--version] <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `pagedkv <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from pagedkv import __version__

        print(f"pagedkv {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"pagedkv: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if argv is None and name in MODEL_COMMANDS:  # a process of its own, nothing started yet
        from pagedkv.engine.host_alloc import reexec_with_huge_pages

        reexec_with_huge_pages()  # returns where there is nothing to do
    target = SUBCOMMANDS[name][0]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(
            f"pagedkv {name}: needs a module that is not installed ({exc.name}); "
            "run ./scripts/setup.sh or install the matching extra",
            file=sys.stderr,
        )
        return 1
    func: Callable[[list[str]], int] = getattr(module, func_name)
    try:
        return func(rest)
    except PagedKVError as exc:  # a failure while running (bad folder, ...): no traceback
        print(f"pagedkv {name}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
