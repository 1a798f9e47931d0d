"""The `train` console entry: a help text printed before is answered from its cache before anything
heavy is imported (launcher.front.help_cache); everything else goes to launcher.front.cli.

Start-up runs with Python's automatic garbage collection off, and the process's last collections
skip everything (launcher.components.collector).
"""

from __future__ import annotations

import sys

from launcher.components import collector


def main() -> None:
    """Console entry point of `train` and `python -m launcher`."""
    collector.pause()
    try:
        _main(sys.argv[1:])
    finally:
        collector.freeze_for_exit()


def _main(argv: list[str]) -> None:
    """A cached help text, else the command line through launcher.front.cli."""
    from launcher.front import help_cache

    if help_cache.cacheable(argv):
        text = help_cache.cached(argv)
        if text is not None:
            sys.stdout.write(text)
            sys.exit(0)
    from launcher.front import cli

    cli.main()
