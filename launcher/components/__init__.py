"""What runs inside a rank and is not parallelism: model, data, checkpoint I/O, objectives, trackers, advisor."""
