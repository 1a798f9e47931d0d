"""`python -m launcher ...` is the same as `train ...`."""

from launcher.front.cli import main

main()
