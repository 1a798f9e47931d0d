"""`python -m launcher ...` is the same as `train ...`."""

from launcher.front.entry import main

main()
