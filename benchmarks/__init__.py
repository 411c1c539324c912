"""Benchmarks behind `rlfleet bench ...`; each prints what it compares, measured side by side in one run."""
