"""Inside a rank: read spec.yaml, build, run the loop. Nothing here imports Hydra."""
