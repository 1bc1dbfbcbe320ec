"""Device idle between steps with constrained responses: 64 concurrent completions, each
constrained by a JSON schema (structured_outputs), against the same load unconstrained, on a
running `chimera serve`. Reads chimera:device_busy_seconds_total and
chimera:device_idle_between_steps_seconds_total from /metrics around each load and prints both
shares (reported rows for tests/gpu/table.py with --json).

python3 tests/gpu/constrained_load.py --port 8017 [--concurrency 64] [--json out.json]
    [--schema plugins/constraint-core/examples/tool_schema.json] [--vocab N] [--bound 0.02]

--bound holds the constrained load's idle share to it (a row that fails above it) and needs
the masks computed while the device runs the forward pass (chimera:engine_late_masks_total
grows); without it both rows are reported.

With --schema, every other constrained request uses the small built-in schema instead: its
strings are enums and its array is bounded, so with at most 16 whitespace characters between
two tokens (the constraint plugin's json_whitespace_max) every such response ends by the
grammar within 400 tokens even from random weights, and each must parse and hold to the
schema (a row that fails otherwise). The given schema (a tool call's, with free strings) runs
to max_tokens on a random model, so its responses say nothing about parsing.
"""

import argparse
import json
import random
import sys
import threading
import time
import urllib.request

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["city", "days", "metric", "tags"],
    "additionalProperties": False,
}


def holds_to_small_schema(obj):
    """Whether `obj` is an instance of SCHEMA (checked by hand: no jsonschema package here)."""
    props = SCHEMA["properties"]
    return (isinstance(obj, dict) and set(obj) == set(SCHEMA["required"])
            and obj["city"] in props["city"]["enum"]
            and isinstance(obj["days"], int) and not isinstance(obj["days"], bool)
            and 1 <= obj["days"] <= 9
            and isinstance(obj["metric"], bool)
            and isinstance(obj["tags"], list) and len(obj["tags"]) <= 4
            and all(t in ("a", "b", "c") for t in obj["tags"]))


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def metrics(port):
    """Each family summed over its labels, and the host time by phase (`phase:NAME`) and the
    constraint plugin's call time (`plugin:constraint`) apart."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    sums = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        family = name.split("{", 1)[0]
        try:
            v = float(value)
        except ValueError:
            continue
        sums[family] = sums.get(family, 0.0) + v
        if family == "chimera:engine_host_seconds_total" and 'phase="' in name:
            phase = name.split('phase="', 1)[1].split('"', 1)[0]
            sums[f"phase:{phase}"] = sums.get(f"phase:{phase}", 0.0) + v
        if family == "chimera:plugin_call_latency_seconds_sum" and 'kind="constrain' in name:
            sums["plugin:constraint"] = sums.get("plugin:constraint", 0.0) + v
    return sums


def load(port, model, concurrency, per_thread, constrained, vocab, schema):
    """Returns the wall time, completion tokens, the constrained responses that ended by the
    grammar and parsed, the small-schema requests sent, and the errors (a small-schema
    response that did not end by the grammar, parse and hold to the schema among them)."""
    errors, tokens, parsed, small = [], [0], [0], [0]
    lock = threading.Lock()

    def worker(seed):
        rng = random.Random(seed)
        for i in range(per_thread):
            body = {"model": model, "prompt": [rng.randrange(3, vocab) for _ in range(64)],
                    "max_tokens": 64, "temperature": 0}
            bounded = constrained and (schema is SCHEMA or (seed + i) % 2 == 1)
            if constrained:
                # Room to finish the object (a random model may take every whitespace allowed).
                body["structured_outputs"] = {"json": SCHEMA if bounded else schema}
                body["max_tokens"] = 400
            else:
                body["ignore_eos"] = True
            try:
                r = post(port, body)
                c = r["choices"][0]
                with lock:
                    tokens[0] += r["usage"]["completion_tokens"]
                    small[0] += bounded
                    if constrained and c["finish_reason"] == "stop":
                        obj = json.loads(c["text"])
                        if bounded and not holds_to_small_schema(obj):
                            raise ValueError(f"not an instance of the small schema: {c['text'][:120]}")
                        parsed[0] += 1
                    elif bounded:
                        raise ValueError(f"a small-schema response ended by {c['finish_reason']} "
                                         f"after {r['usage']['completion_tokens']} tokens")
            except Exception as e:  # noqa: BLE001 -- counted and reported
                with lock:
                    errors.append(repr(e)[:200])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.time() - start, tokens[0], parsed[0], small[0], errors


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--per-thread", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--schema", help="a JSON schema file (default: a small one of four fields)")
    p.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn below this")
    p.add_argument("--bound", type=float, help="idle/busy bound of the constrained load")
    args = p.parse_args()
    schema = json.loads(open(args.schema).read()) if args.schema else SCHEMA
    models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{args.port}/v1/models").read())
    model = models["data"][0]["id"]
    vocab = args.vocab
    rows = []
    for constrained in (False, True):
        before = metrics(args.port)
        wall, tokens, parsed, small, errors = load(args.port, model, args.concurrency,
                                                   args.per_thread, constrained, vocab, schema)
        after = metrics(args.port)
        busy = after.get("chimera:device_busy_seconds_total", 0) - before.get("chimera:device_busy_seconds_total", 0)
        idle = (after.get("chimera:device_idle_between_steps_seconds_total", 0)
                - before.get("chimera:device_idle_between_steps_seconds_total", 0))
        mask_wait = (after.get("chimera:device_mask_wait_seconds_total", 0)
                     - before.get("chimera:device_mask_wait_seconds_total", 0))
        steps = after.get("chimera:engine_steps_total", 0) - before.get("chimera:engine_steps_total", 0)
        late = (after.get("chimera:engine_late_masks_total", 0)
                - before.get("chimera:engine_late_masks_total", 0))
        n = args.concurrency * args.per_thread
        kind = "constrained (JSON schema)" if constrained else "unconstrained"
        share = f"{100 * idle / busy:.1f} %" if busy > 0 else "n/a (no device timing)"
        measured = (f"idle/busy {share} ({1e3 * idle:.0f} of {1e3 * busy:.0f} ms, "
                    f"{steps:.0f} steps, {1e3 * busy / max(steps, 1):.2f} ms busy a step); "
                    f"{tokens} tokens in {wall:.1f} s"
                    + (f"; {parsed}/{n} ended by the grammar and parsed ({small} of the small "
                       f"schema, each of which must); {late:.0f} masks "
                       f"computed during the forward pass, the device waiting {1e3 * mask_wait:.0f} ms "
                       f"of the idle for them" if constrained else "")
                    + (f"; {len(errors)} errors: {errors[0]}" if errors else ""))
        per_step = lambda key: 1e6 * (after.get(key, 0) - before.get(key, 0)) / max(steps, 1)
        phases = sorted(k for k in after if k.startswith("phase:"))
        measured += "; host µs a step: " + ", ".join(f"{k[6:]} {per_step(k):.0f}" for k in phases)
        if constrained:
            measured += f"; constraint plugin {per_step('plugin:constraint'):.0f}"
        ok = not errors and (not constrained or small > 0)
        bound = "reported"
        if constrained and args.bound is not None:
            bound = f"<= {100 * args.bound:g} %, masks during the forward pass"
            ok = ok and busy > 0 and idle / busy <= args.bound and late > 0
        print(f"{kind}, c={args.concurrency}: {measured} {'ok' if ok else 'FAILED'}", flush=True)
        label = " (reported)" if bound == "reported" else ""
        rows.append({"suite": "serve", "check": f"device idle between steps, {n} {kind} completions at c={args.concurrency}{label}",
                     "measured": measured, "bound": bound, "pass": ok})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    sys.exit(0 if all(r["pass"] for r in rows) else 1)


if __name__ == "__main__":
    main()
