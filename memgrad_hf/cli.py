"""``memgrad-hf`` command: ``demo`` and ``bench NAME``."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

USAGE = """usage: memgrad-hf <command> [options]

commands:
  demo             train a small model with and without memgrad_hf and print the comparison table
  bench NAME       run benchmarks/NAME.py from a source checkout (`memgrad-hf bench` lists them)
"""


def _benchmarks_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "benchmarks"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        from memgrad_hf import __version__

        print(f"memgrad-hf {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2  # (no command: a usage error)
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from memgrad_hf.demo import main as demo_main

        return demo_main(rest)
    if cmd == "bench":
        bdir = _benchmarks_dir()
        found = bdir.glob("*.py") if bdir.is_dir() else []
        # the runnable ones: a benchmark defines main(); helper modules (harness, compat's per-feature checks) do not
        names = sorted(p.stem for p in found if "\ndef main(" in p.read_text())
        if not rest or rest[0] in ("-h", "--help"):
            print(f"usage: memgrad-hf bench NAME [options]; NAME is one of: {', '.join(names) or '(none found)'}")
            return 0
        if rest[0] not in names:
            print(f"memgrad-hf bench: {rest[0]!r} is not a benchmark in {bdir} (benchmarks run from a source checkout, "
                  f"installed with `pip install -e .`); available: {', '.join(names) or 'none'}", file=sys.stderr)
            return 2
        # Imported as benchmarks.NAME (not run as a path) so that spawned measuring processes can unpickle its cases.
        if str(bdir.parent) not in sys.path:
            sys.path.insert(0, str(bdir.parent))
        module = importlib.import_module(f"benchmarks.{rest[0]}")
        return int(module.main(rest[1:]) or 0)
    print(f"memgrad-hf: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
