"""Every cross-field rule of the run spec, one module per area."""
