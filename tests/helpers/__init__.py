"""Shared pieces of the tests: the tiny drafters (tiny_drafters.py), the programs they and the
loop's checks share (programs.py), running and checking the speculative loop (loop_checks.py),
and the checks that need 8 virtual devices, each run in its own process (sharded_checks.py)."""
