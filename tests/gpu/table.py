#!/usr/bin/env python3
"""Prints one table from the JSON files of a GPU run (chimera-gpu-check's and the Python
scripts'); exits non-zero if any row failed or no row was found."""
import json
import sys

rows = []
for path in sys.argv[1:]:
    try:
        data = json.load(open(path))
    except (OSError, ValueError) as e:
        rows.append({"suite": "-", "check": f"{path}: unreadable ({e})", "measured": "-",
                     "bound": "-", "pass": False})
        continue
    rows.extend(data["rows"] if isinstance(data, dict) else data)
w = max([len(r["check"]) for r in rows] + [5])
print(f"{'suite':<8} | {'check':<{w}} | {'measured':>18} | {'bound':>16} | pass")
print("-" * (w + 56))
for r in rows:
    print(f"{r['suite']:<8} | {r['check']:<{w}} | {r['measured']:>18} | {r['bound']:>16} | "
          f"{'yes' if r['pass'] else 'NO'}")
failed = sum(1 for r in rows if not r["pass"])
print(f"{len(rows)} checks, {failed} failed")
sys.exit(1 if failed or not rows else 0)
