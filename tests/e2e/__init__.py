"""End-to-end tests: launchers, faults, builds, families, and the real engines (interop/)."""
