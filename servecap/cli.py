"""The one console script: `servecap sim run --rate 40` is `python -m sim run --rate 40`, and so on for each
package's command line. A package is imported only when named, so `servecap sim ...` never imports torch."""
from __future__ import annotations

import sys

from servecap.traces.command import entry

COMMANDS = {"sim": "the simulator: run, sweep, capacity", "engine": "the real engine on a GPU: run, gate, bench",
            "calibrate": "measure a cost table on a GPU, or correct one from real runs",
            "traces": "import, generate, show, explain and compare traces and run records",
            "validate": "blind plans, real runs and graded reports"}


def _usage() -> str:
    lines = ["usage: servecap COMMAND [ARGS ...]  (servecap COMMAND --help for each)", "", "commands:"]
    lines += [f"  {name:10s} {what}" for name, what in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"servecap: error: unknown command {name!r}; choose {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    sys.argv = [f"servecap {name}", *rest]
    return entry(f"servecap {name}", f"servecap.{name}.cli", rest)
