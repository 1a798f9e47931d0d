"""`python -m launcher ...` is the same as `train ...`."""

from launcher.cli import main

main()
