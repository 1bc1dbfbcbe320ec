#!/usr/bin/env python3
"""After the openai-client test: a streamed completion whose client hangs up mid-stream must
free its request and blocks (checked on /metrics). Writes rows in chimera-gpu-check's JSON
format, including the openai-client test's result."""
import argparse
import http.client
import json
import re
import time

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True)
p.add_argument("--json", required=True)
p.add_argument("--openai-rc", type=int, required=True)
p.add_argument("--openai-log", required=True)
args = p.parse_args()


def metric(name):
    c = http.client.HTTPConnection("127.0.0.1", args.port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)]
    return sum(vals)


log = open(args.openai_log).read().strip().splitlines()
summary = log[-1] if log else "no output"
rows = [{"suite": "serve", "check": "openai client test against chimera serve --backend cuda (f32)",
         "measured": summary[:40], "bound": "0 failed", "pass": args.openai_rc == 0,
         "value": float(args.openai_rc)}]

before = metric("chimera:kv_cache_usage_perc")
c = http.client.HTTPConnection("127.0.0.1", args.port, timeout=30)
# The fixture's context is 512 tokens: a short prompt and 480 new tokens keep it busy.
body = json.dumps({"model": "llama-gqa", "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 480,
                   "stream": True, "ignore_eos": True})
c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
r = c.getresponse()
if r.status != 200:
    print("stream refused:", r.status, r.read()[:300])
for _ in range(3):
    r.readline()
running = metric("chimera:num_requests_running")
c.sock.close()
freed = False
for _ in range(50):
    time.sleep(0.1)
    if metric("chimera:num_requests_running") == 0 and metric("chimera:kv_cache_usage_perc") <= before:
        freed = True
        break
rows.append({"suite": "serve", "check": "a hung-up stream frees its request and blocks",
             "measured": f"running {running:.0f} → {metric('chimera:num_requests_running'):.0f}",
             "bound": "freed", "pass": freed and running >= 1, "value": float(freed)})
json.dump({"rows": rows}, open(args.json, "w"), indent=1)
for row in rows:
    print(row["check"], row["measured"], "ok" if row["pass"] else "FAIL")
