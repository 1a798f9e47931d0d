"""The launching process: the command line, composition, dry run, sweeps and offline commands."""
