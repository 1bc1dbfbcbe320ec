"""Runs a test module's `test_*` functions as a plain script (no pytest needed): prints each
result and "N passed, M failed", and exits non-zero if any failed."""

import sys


def run_tests(namespace):
    tests = [(n, f) for n, f in sorted(namespace.items()) if n.startswith("test_") and callable(f)]
    failed = 0
    for name, f in tests:
        try:
            f()
            print(f"ok   {name}")
        except Exception as e:  # report every failure, then exit non-zero
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
    print(f"{len(tests) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
