"""`python -m launcher.rank SPEC_YAML`: one rank in a process of its own, as `python -m launcher.rank.worker`
runs it, with torch and the package imported while Python's collector is paused (components/collector.py):
its passes over the half a million objects those imports make cost about 0.8 s of CPU per rank."""

from launcher.components import collector

collector.pause()

from launcher.rank import worker  # noqa: E402  (after the pause: the imports are what it is for)

worker.main()
