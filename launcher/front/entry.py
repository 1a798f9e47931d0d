"""The `train` console entry: a help text printed before is answered from its cache before anything
heavy is imported (launcher.front.help_cache); everything else goes to launcher.front.cli."""

from __future__ import annotations

import sys


def main() -> None:
    """Console entry point of `train` and `python -m launcher`."""
    from launcher.front import help_cache

    argv = sys.argv[1:]
    if help_cache.cacheable(argv):
        text = help_cache.cached(argv)
        if text is not None:
            sys.stdout.write(text)
            sys.exit(0)
    from launcher.front import cli

    cli.main()
