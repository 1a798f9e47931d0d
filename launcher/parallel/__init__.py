"""Parallel strategies (peers behind one registry), the topology owner (dims) and the loop's guarded step."""
