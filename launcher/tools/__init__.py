"""Offline commands over a finished run: export, merge, quantize, generate."""
