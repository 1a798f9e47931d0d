"""Reading files without running code from them: torch files weights-only, DCP through an allowlist."""
