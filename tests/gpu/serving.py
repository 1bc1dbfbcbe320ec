#!/usr/bin/env python3
"""Serving benchmarks on the GPU: `chimera bench` against a real `chimera serve`, with dummy
weights of a full-size model (NemotronH-8B's shape by default), started by this script.

    python3 tests/gpu/serving.py caching [--quick]   # one GPU: prefix caching on vs off + rate sweep
    python3 tests/gpu/serving.py routing [--quick]   # two GPUs: prefix-aware vs least-loaded routing
    python3 tests/gpu/serving.py idle [--quick]      # one GPU: device idle between steps at c = 1, 64, 256
    python3 tests/gpu/serving.py prefill [--quick]   # one GPU: an 8192-token prompt vs the GEMM rate
    python3 tests/gpu/serving.py dynamo [--quick]    # one GPU: two Dynamo workers, KV router vs round robin

--quick runs a small workload with looser bounds of its own (tests/gpu/bounds.py), which a build
that lost the property still fails.

Each scenario starts the servers it compares one after the other from the same binary, on the
same port, with the same seeded traffic. Rows (check | measured | bound | pass) go to
$OUT/serving-<scenario>.json for tests/gpu/table.py; the bench reports, server logs and the
rate-sweep plot are packed into $OUT/serving-<scenario>.tgz.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

import bounds  # tests/gpu/bounds.py: the pass rules, unit-tested by tests/gpu/test_bounds.py

ROOT = Path(__file__).resolve().parents[2]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["caching", "routing", "idle", "prefill", "dynamo"])
    p.add_argument("--quick", action="store_true", help="a small workload to check the set-up")
    p.add_argument("--bin", default=str(ROOT / ".gpu/chimera"))
    p.add_argument("--worker-bin", default=str(ROOT / ".gpu/chimera-dynamo"),
                   help="dynamo: the Dynamo worker binary")
    p.add_argument("--dynamo-stage",
                   default=os.environ.get("CHIMERA_DYNAMO_STAGE",
                                          str(Path.home() / "chimera-dynamo-stage")),
                   help="dynamo: where tests/gpu/dynamo_stage.sh put Dynamo's frontend, etcd and NATS")
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".gpu/out")))
    p.add_argument("--model-config", default=str(ROOT / "tests/gpu/configs/nemotron-h-8b"))
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--no-sweep", action="store_true", help="caching: skip the rate sweep")
    p.add_argument("--engine-extra", default="",
                   help="idle, caching: a line added to the servers' [engine] section "
                        "(e.g. 'schedule_ahead = false'; named in the idle rows)")
    p.add_argument("--max-running", type=int, default=128,
                   help="caching: engine.max_running of the servers (a model with a large "
                        "recurrent state per sequence, Qwen3.5-27B's 151 MB, needs fewer on an H100)")
    p.add_argument("--max-batched-tokens", type=int, default=4096,
                   help="engine.max_batched_tokens of the servers (the prefill chunk)")
    return p.parse_args()


class Runner:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.work = self.out / f"serving-{args.scenario}"
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.model = Path("/tmp/chimera-serving-model")
        subprocess.run([sys.executable, str(ROOT / "tests/gpu/serving_model.py"),
                        args.model_config, str(self.model)], check=True)
        self.rows = []

    def row(self, check, measured, bound, ok):
        self.rows.append({"suite": "serving", "check": check, "measured": measured,
                          "bound": bound, "pass": bool(ok)})
        print(f"  {check}: {measured} ({bound}) {'ok' if ok else 'FAILED'}", flush=True)

    def serve(self, name, toml):
        """Starts `chimera serve` with this config; returns the process once /health answers."""
        cfg = self.work / f"{name}.toml"
        cfg.write_text(toml)
        log = open(self.work / f"{name}.log", "w")
        started = time.time()
        proc = subprocess.Popen([self.args.bin, "serve", "--config", str(cfg),
                                 "--port", str(self.args.port)], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{self.args.port}/health"
        while time.time() - started < 300:
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: chimera serve exited with {proc.returncode}; "
                                   f"see {cfg.with_suffix('.log')}:\n" + tail(cfg.with_suffix(".log")))
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        print(f"== {name}: serving after {time.time() - started:.1f} s", flush=True)
                        return proc
            except OSError:
                pass
            time.sleep(0.5)
        proc.kill()
        raise RuntimeError(f"{name}: not healthy after 300 s")

    @staticmethod
    def stop(proc):
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def bench(self, label, workload, load, extra=()):
        out = self.work / f"{label}.json"
        cmd = [self.args.bin, "bench", "--url", f"http://127.0.0.1:{self.args.port}",
               "--prompt-format", "token-ids", "--tokenizer", str(self.model / "tokenizer.json"),
               "--ignore-eos", "--no-progress", "--seed", "1", "--label", label,
               "--output", str(out), *workload, *load, *extra]
        started = time.time()
        with open(self.work / f"{label}.txt", "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=560).returncode
        print(f"   bench {label}: rc {rc}, {time.time() - started:.1f} s", flush=True)
        print(tail(self.work / f"{label}.txt", 14), flush=True)
        if rc != 0:
            raise RuntimeError(f"bench {label} failed (rc {rc})")
        return json.loads(out.read_text())

    def metrics(self):
        """Sums each `chimera:` counter over the engines of /metrics."""
        url = f"http://127.0.0.1:{self.args.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        sums = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            name, _, labels = name.partition("{")
            for key in ("phase", "kind"):
                if f'{key}="' in labels:
                    name += "/" + labels.split(f'{key}="', 1)[1].split('"', 1)[0]
            try:
                sums[name] = sums.get(name, 0.0) + float(value)
            except ValueError:
                pass
        return sums

    def cache_rows(self, name):
        """The server's own cache counters after a run: prefix-cache misses by reason and SSM
        snapshots skipped for want of a slot (reported)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.args.port}/metrics",
                                      timeout=10).read().decode()
        misses, skipped = {}, 0.0
        for line in text.splitlines():
            if line.startswith("chimera:prefix_cache_misses_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                misses[reason] = misses.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
            elif line.startswith("chimera:ssm_snapshots_skipped_total{"):
                skipped += float(line.rsplit(" ", 1)[1])
        shown = ", ".join(f"{k} {v:.0f}" for k, v in sorted(misses.items()) if v) or "none"
        self.row(f"{name}: prefix-cache misses by reason; SSM snapshots skipped (reported)",
                 f"{shown}; {skipped:.0f}", "reported", True)

    def config(self, caching, engine_extra="", cache_extra="", router="builtin:prefix-aware",
               max_running=128, memory_fraction=True, budget=None):
        budget = budget or ("8GiB" if self.args.backend == "cuda" else "1GiB")
        return f"""[model]
path = "{self.model}"
load_format = "dummy"
dtype = "{self.args.dtype}"

[engine]
backend = "{self.args.backend}"
max_batched_tokens = {self.args.max_batched_tokens}
max_running = {max_running}
{engine_extra}

[cache]
prefix_caching = {"true" if caching else "false"}
{"memory_fraction = 0.85" if memory_fraction else ""}
memory_budget = "{budget}"
# A hybrid's KV is small (NemotronH-8B: 4 attention layers, 16 KiB a token) and its SSM
# slots large (about 100 MB in f32): most of the budget goes to live states and snapshots.
ssm_share = 0.6
{cache_extra}

[policy.router]
plugin = "{router}"
"""

    def finish(self):
        path = self.out / f"serving-{self.args.scenario}.json"
        path.write_text(json.dumps({"rows": self.rows}, indent=1))
        with tarfile.open(self.out / f"serving-{self.args.scenario}.tgz", "w:gz") as t:
            t.add(self.work, arcname=self.work.name)
        shutil.rmtree(self.work, ignore_errors=True)


def tail(path, n=20):
    try:
        return "".join(Path(path).read_text(errors="replace").splitlines(keepends=True)[-n:])
    except OSError:
        return ""


def point(report, i=0):
    return report["points"][i]


def ttft_p50(p):
    return p["latency_ms"]["ttft"]["p50"]


def caching(r, quick):
    if quick:
        sizes = ["--groups", "8", "--prompts-per-group", "4", "--prefix-len", "2048",
                 "--question-len", "128", "--output-len", "32"]
        load = ["--concurrency", "16"]
        rates, per_rate = "2,8", "16"
    else:
        # The workload: 64 groups x 16 prompts, 2048-token prefix, 128-token question,
        # 256 output tokens; 64 clients.
        sizes = ["--groups", "64", "--prompts-per-group", "16", "--prefix-len", "2048",
                 "--question-len", "128", "--output-len", "256"]
        load = ["--concurrency", "64"]
        rates, per_rate = "4,8,16,32", "160"
    workload = ["--workload", "shared-prefix", *sizes]
    reports, sweep = {}, None
    for caching_on in (True, False):
        name = "caching-on" if caching_on else "caching-off"
        proc = r.serve(name, r.config(caching_on, engine_extra=r.args.engine_extra,
                                      max_running=r.args.max_running))
        try:
            reports[caching_on] = r.bench(name, workload, load)
            r.cache_rows(name)
            m = r.metrics()
            late = m.get("chimera:engine_late_admissions_total", 0.0)
            admitted = m.get("chimera:engine_steps_total", 0.0)
            r.row(f"{name}{', ' + r.args.engine_extra if r.args.engine_extra else ''}: requests "
                  f"that joined a step scheduled ahead while the one before computed (reported)",
                  f"{late:.0f} (in {admitted:.0f} steps)", "reported", True)
            if caching_on and not r.args.no_sweep:
                sweep = r.bench("rate-sweep", workload,
                                ["--request-rate", rates, "--num-requests", per_rate],
                                ["--plot", str(r.work / "rate-sweep.svg")])
        finally:
            r.stop(proc)
    on, off = point(reports[True]), point(reports[False])
    for label, p in (("on", on), ("off", off)):
        failed = p["requests"]["failed"]
        r.row(f"shared-prefix caching {label}: requests completed / failed",
              f"{p['requests']['completed']} / {failed}", "0 failed", failed == 0)
    ratio = ttft_p50(off) / ttft_p50(on)
    bound, ok = bounds.caching_ttft(ratio, on["cache_hit_ratio"], quick)
    r.row("prefix caching on vs off: median TTFT",
          f"{ratio:.2f}x ({ttft_p50(on):.0f} / {ttft_p50(off):.0f} ms)", bound, ok)
    tput = on["throughput"]["output_tokens_per_s"] / off["throughput"]["output_tokens_per_s"]
    r.row("prefix caching on vs off: output throughput (reported)",
          f"{tput:.2f}x ({on['throughput']['output_tokens_per_s']:.0f} tok/s)", "reported", True)
    r.row("prefix caching on: prompt tokens served from cache (reported)",
          f"{100 * on['cache_hit_ratio']:.1f} %", "reported", True)
    for p in sweep["points"] if not r.args.no_sweep else []:
        lat = p["latency_ms"]
        r.row(f"rate sweep {p['load']['value']:g} req/s: out tok/s | TTFT p50/p99 | ITL p50",
              f"{p['throughput']['output_tokens_per_s']:.0f} | {lat['ttft']['p50']:.0f}/"
              f"{lat['ttft']['p99']:.0f} | {lat['itl']['p50']:.1f} ms", "reported",
              p["requests"]["failed"] == 0)


def routing(r, quick):
    # Multi-tenant: many tenants' long shared prefixes (system prompts, documents), short
    # questions and answers, so prefill dominates and where a prefix lives matters.
    if quick:
        sizes = ["--groups", "8", "--prompts-per-group", "4", "--prefix-len", "4096",
                 "--question-len", "128", "--output-len", "32"]
        load = ["--concurrency", "16"]
    else:
        # 768 tenants: their prefixes' SSM states (about 100 MB each in f32) are more than one
        # replica's snapshot slots hold (656 at ssm_share = 0.6) and fewer than two replicas'
        # hold. Prefix-aware routing keeps a tenant on one replica, so each replica caches
        # half of them and computes each prefix once; least-loaded routing sends every
        # tenant to both replicas, so each computes every prefix and churns its slots.
        sizes = ["--groups", "768", "--prompts-per-group", "4", "--prefix-len", "2048",
                 "--question-len", "128", "--output-len", "32"]
        load = ["--concurrency", "64"]
    workload = ["--workload", "shared-prefix", *sizes]
    engine = "devices = [0, 1]\nreplicas = 2"
    reports = {}
    for router in ("builtin:prefix-aware", "builtin:least-loaded"):
        name = router.split(":")[1]
        proc = r.serve(name, r.config(True, engine_extra=engine, router=router))
        try:
            reports[router] = r.bench(name, workload, load)
            r.cache_rows(name)
        finally:
            r.stop(proc)
        log = (r.work / f"{name}.log").read_text(errors="replace")
        on_both = "device=0" in log and "device=1" in log
        r.row(f"{name}: model loaded on GPU 0 and GPU 1", "yes" if on_both else "no", "both",
              on_both)
    pa, ll = point(reports["builtin:prefix-aware"]), point(reports["builtin:least-loaded"])
    for label, p in (("prefix-aware", pa), ("least-loaded", ll)):
        failed = p["requests"]["failed"]
        r.row(f"{label}: requests completed / failed | cache hit",
              f"{p['requests']['completed']} / {failed} | {100 * p['cache_hit_ratio']:.1f} %",
              "0 failed", failed == 0)
    ratio = pa["throughput"]["total_tokens_per_s"] / ll["throughput"]["total_tokens_per_s"]
    r.row("prefix-aware vs least-loaded routing: throughput (total tok/s)",
          f"{ratio:.2f}x ({pa['throughput']['total_tokens_per_s']:.0f} / "
          f"{ll['throughput']['total_tokens_per_s']:.0f})", *bounds.routing_throughput(ratio, quick))
    r.row("prefix-aware vs least-loaded routing: median TTFT (reported)",
          f"{ttft_p50(pa):.0f} / {ttft_p50(ll):.0f} ms", "reported", True)


def dynamo(r, quick):
    """chimera as NVIDIA Dynamo workers on one GPU: etcd, NATS, Dynamo's frontend and
    `chimera-dynamo` workers sharing the GPU (each its own process, cache budget and CUDA
    graphs), started and driven by `chimera bench --dynamo-workers` (the harness of
    host/bench/src/cluster.rs). Multi-turn conversations, each with its own system prompt, sent
    as text so that every turn carries the whole history: the frontend's KV router (fed by the
    workers' KV events under the hybrid rule) against round robin over two workers, and one
    worker taking all the traffic as the reference for reuse."""
    stage = Path(r.args.dynamo_stage)
    if not (stage / "ready").exists():
        raise RuntimeError(f"{stage}: no staged Dynamo frontend; run tests/gpu/dynamo_stage.sh")
    env = dict(os.environ)
    env["PATH"] = f"{stage / 'bin'}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{stage / 'site'}" + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
    env["CHIMERA_DYNAMO_PYTHON"] = sys.executable
    env["HF_HUB_OFFLINE"] = "1"
    env["CHIMERA_KEEP_CLUSTER"] = "1"
    # One line per finished request in the workers' logs (announced blocks at arrival, tokens
    # reused, the cache's miss reason): what explains a turn routed without its state.
    env.setdefault("DYN_LOG", "info,chimera_dynamo=debug")
    if quick:
        sizes = ["--conversations", "8", "--turns", "3", "--prefix-len", "1024",
                 "--question-len", "128", "--output-len", "32"]
        load = ["--concurrency", "8"]
    else:
        # 32 conversations of 4 turns: a 1024-token system prompt of its own each, 256-token
        # questions, 128-token answers (the 4th turn's prompt is 2,432 tokens); 16 clients.
        sizes = ["--conversations", "32", "--turns", "4", "--prefix-len", "1024",
                 "--question-len", "256", "--output-len", "128"]
        load = ["--concurrency", "16"]
    workload = ["--workload", "multi-turn", *sizes]
    # Two processes share the GPU: an explicit cache budget each (a fraction of free memory
    # would let the first take what the second needs). NemotronH-8B's live state is 98.8 MiB
    # a request in f32: 32 running take 3.1 GiB of the 9.6 GiB SSM share of 16 GiB, the rest
    # holds about 66 snapshots for the conversations' prefixes; two workers' weights (16 GB
    # each) and caches fit one 80 GB card.
    cfg = r.work / "worker.toml"
    budget = "16GiB" if r.args.backend == "cuda" else None
    cfg.write_text(r.config(True, max_running=32, memory_fraction=False, budget=budget))
    reports = {}
    for label, workers, router in (("one-worker", 1, "kv"), ("kv", 2, "kv"),
                                   ("round-robin", 2, "round-robin")):
        out = r.work / f"dynamo-{label}.json"
        # The KV router weighs a turn's cached prefill (1,300–2,300 tokens here) against the
        # blocks the workers' running requests hold at 4 to 1, not Dynamo's default 1 to 1,
        # which sends a burst of follow-up turns to the idle worker to recompute their state
        # (docs/cluster.md). Round robin ignores it.
        frontend = "--router-prefill-load-scale 4" if router == "kv" else ""
        cmd = [r.args.bin, "bench", "--dynamo-workers", str(workers), "--dynamo-router", router,
               "--dynamo-worker", r.args.worker_bin, "--dynamo-worker-args", f"--config {cfg}",
               "--dynamo-block-size", "16", "--dynamo-frontend-args", frontend,
               "--endpoint", "completions", "--prompt-format", "text",
               "--tokenizer", str(r.model / "tokenizer.json"), "--ignore-eos", "--no-progress",
               "--seed", "1", "--label", label, "--output", str(out), *workload, *load]
        started = time.time()
        # Cluster folders of other runs on this machine are theirs: only this run's are taken.
        others = set(Path(tempfile.gettempdir()).glob("chimera-dynamo-cluster-*"))
        with open(r.work / f"dynamo-{label}.txt", "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=480).returncode
        print(f"   bench dynamo {label}: rc {rc}, {time.time() - started:.1f} s", flush=True)
        print(tail(r.work / f"dynamo-{label}.txt", 16), flush=True)
        # The harness keeps its folder (CHIMERA_KEEP_CLUSTER): the workers' and frontend's
        # logs go into this scenario's archive (etcd's and NATS's data do not).
        for d in sorted(set(Path(tempfile.gettempdir()).glob("chimera-dynamo-cluster-*")) - others):
            keep = r.work / f"cluster-{label}-{d.name.rsplit('-', 1)[-1]}"
            keep.mkdir()
            for log in d.glob("*.log"):
                shutil.copy(log, keep / log.name)
            shutil.rmtree(d, ignore_errors=True)
        if rc != 0:
            raise RuntimeError(f"bench dynamo {label} failed (rc {rc})")
        reports[label] = json.loads(out.read_text())
    # Reuse is counted by the workers (prompt tokens their engines found cached, summed over
    # the workers' /metrics), which does not depend on the frontend passing usage details on.
    def reused(label):
        return float(reports[label].get("metadata", {}).get("dynamo.reused_prompt_tokens", 0))

    for label, rep in reports.items():
        p = point(rep)
        meta = rep.get("metadata", {})
        failed = p["requests"]["failed"]
        r.row(f"{label}: requests completed / failed | prompt tokens reused by the workers "
              f"(and as the client saw them)",
              f"{p['requests']['completed']} / {failed} | {reused(label):.0f} of "
              f"{meta.get('dynamo.prompt_tokens', '?')} ({p['tokens']['cached']})", "0 failed",
              failed == 0 and p["requests"]["completed"] > 0)
    one, kv, rr = (point(reports[k]) for k in ("one-worker", "kv", "round-robin"))
    for label in ("kv", "round-robin"):
        bound, ok = bounds.dynamo_reuse(reused(label), reused("one-worker"))
        r.row(f"{label} router, 2 workers: prompt tokens reused / one worker's",
              f"{reused(label) / max(reused('one-worker'), 1):.3f}",
              bound if label == "kv" else "reported", ok if label == "kv" else True)
    without = reports["kv"].get("metadata", {}).get("dynamo.routed_without_state", "missing")
    r.row("kv router: turns routed to a worker whose announced blocks had no state behind them",
          str(without), "0", without == "0")
    for label in ("kv", "round-robin"):
        lost = reports[label].get("metadata", {}).get("dynamo.routed_state_evicted", "missing")
        r.row(f"{label}: turns whose announced state was evicted between arrival and admission "
              f"(memory pressure; reported)", str(lost), "reported", True)
    for label, p in (("one-worker", one), ("kv", kv), ("round-robin", rr)):
        lat = p["latency_ms"]
        r.row(f"{label}: median TTFT | output tok/s | total tok/s | ITL p50 (reported)",
              f"{lat['ttft']['p50']:.0f} ms | {p['throughput']['output_tokens_per_s']:.0f} | "
              f"{p['throughput']['total_tokens_per_s']:.0f} | {lat['itl']['p50']:.1f} ms",
              "reported", True)
    r.row("kv vs round robin: median TTFT, total throughput (reported)",
          f"{ttft_p50(rr) / ttft_p50(kv):.2f}x faster, "
          f"{kv['throughput']['total_tokens_per_s'] / rr['throughput']['total_tokens_per_s']:.2f}x",
          "reported", True)


def idle(r, quick):
    """Device idle time between back-to-back engine steps (CUDA events in the engine), as a
    share of device busy time, on a decode-heavy workload at 1, 64 and 256 concurrent
    requests through the whole serving path (HTTP, scheduler, Wasm sampler, cache)."""
    proc = r.serve("idle", r.config(True, engine_extra=r.args.engine_extra, max_running=256))
    extra = f", {r.args.engine_extra}" if r.args.engine_extra else ""
    busy_name = "chimera:device_busy_seconds_total"
    idle_name = "chimera:device_idle_between_steps_seconds_total"
    try:
        for c in (1, 64, 256):
            requests = 2 * c if c > 1 else (2 if quick else 4)
            output = 64 if quick else 256
            before = r.metrics()
            p = point(r.bench(f"idle-c{c}",
                              ["--workload", "random", "--input-len", "128",
                               "--output-len", str(output), "--num-requests", str(requests)],
                              ["--concurrency", str(c)]))
            after = r.metrics()
            busy = after.get(busy_name, 0.0) - before.get(busy_name, 0.0)
            gap = after.get(idle_name, 0.0) - before.get(idle_name, 0.0)
            share = gap / busy if busy > 0 else float("nan")
            delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
            steps = delta.get("chimera:engine_steps_total", 0.0)
            if steps > 0:
                host = " ".join(
                    f"{phase} {1e6 * delta.get('chimera:engine_host_seconds_total/' + phase, 0.0) / steps:.0f}"
                    for phase in ("schedule", "inputs", "update", "between", "launch", "overlap",
                                  "top_up"))
                host += "; steps " + " / ".join(
                    f"{kind} {delta.get('chimera:engine_steps_by_kind_total/' + kind, 0.0):.0f}"
                    for kind in ("eager", "decode_graph", "mixed_graph"))
                r.row(f"host time per step at c={c}{extra}, µs by phase (reported; {steps:.0f} "
                      f"steps, device {1e3 * busy / steps:.2f} ms/step)", host, "reported", True)
            r.row(f"device idle between steps / busy, c={c}{extra} ({requests} requests, 128 in, "
                  f"{output} out, ITL p50 {p['latency_ms']['itl']['p50']:.2f} ms)",
                  f"{100 * share:.2f} % ({1e3 * gap:.0f} of {1e3 * busy:.0f} ms)",
                  *bounds.idle_share(share, busy, quick))
    finally:
        r.stop(proc)


def model_flops(config, t):
    """Model FLOPs of a T-token prefill: 2 per weight per token for every projection (the LM
    head for the last token only), causal attention's QKᵀ and PV, and the SSD scan's
    intra-chunk and state terms for Mamba2 layers."""
    c = json.loads(Path(config, "config.json").read_text())
    h = c["hidden_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    d = c.get("head_dim") or h // heads
    attn = h * (heads + 2 * kv) * d + heads * d * h
    if c.get("model_type") == "nemotron_h":
        kinds = c["hybrid_override_pattern"]
        mh, md, g, n = c["mamba_num_heads"], c["mamba_head_dim"], c["n_groups"], c["ssm_state_size"]
        inner = mh * md
        mamba = h * (2 * inner + 2 * g * n + mh) + inner * h
        mlp = 2 * h * c["intermediate_size"]
        weights = sum({"M": mamba, "*": attn, "-": mlp}[k] for k in kinds)
        n_attn = kinds.count("*")
        chunk = c.get("chunk_size", 128)
        # Per token and head: C·B scores within the chunk and their use on x, plus the state
        # update and read-out (2·N·P each).
        ssd = kinds.count("M") * mh * (2 * chunk * (n + md) + 4 * n * md)
    else:
        mlp = 3 * h * c["intermediate_size"]
        weights = c["num_hidden_layers"] * (attn + mlp)
        n_attn = c["num_hidden_layers"]
        ssd = 0
    return 2 * weights * t + 2 * h * c["vocab_size"] + n_attn * 2 * t * t * heads * d + ssd * t


def gemm_rate():
    """bf16 GEMM TFLOP/s of torch (cuBLAS) on an 8192 × 4096 × 14336 product, median of 20."""
    import torch
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    ms = sorted(times)[len(times) // 2]
    return 2 * 8192 * 4096 * 14336 / ms / 1e9


def prefill(r, quick):
    """One 8192-token prompt through `chimera serve` (chunked prefill, paged KV, 4096-token
    steps), time to first token against the GEMM rate measured just before."""
    rate = gemm_rate()
    r.row("torch bf16 GEMM 8192x4096x14336 (the rate prefill is held to)", f"{rate:.0f} TFLOP/s",
          "measured", True)
    configs = [ROOT / "tests/gpu/configs/llama-3-8b", ROOT / "tests/gpu/configs/nemotron-h-8b"]
    for config in configs[:1] if quick else configs:
        subprocess.run([sys.executable, str(ROOT / "tests/gpu/serving_model.py"), str(config),
                        str(r.model), "16384"], check=True)
        name = config.name
        proc = r.serve(f"prefill-{name}", r.config(True))
        try:
            p = point(r.bench(f"prefill-{name}",
                              ["--workload", "random", "--input-len", "8192", "--output-len", "1",
                               "--num-requests", "2" if quick else "5"],
                              ["--concurrency", "1", "--warmup", "1"]))
        finally:
            r.stop(proc)
        ttft = p["latency_ms"]["ttft"]["p50"]
        tflops = model_flops(config, 8192) / ttft / 1e9
        r.row(f"{name}: 8192-token prompt, median TTFT (model FLOP/s; share of the GEMM rate)",
              f"{ttft:.1f} ms ({tflops:.0f} TFLOP/s, {100 * tflops / rate:.0f} %)",
              *bounds.prefill_share(tflops, rate, quick))


def main():
    args = parse_args()
    r = Runner(args)
    try:
        {"caching": caching, "routing": routing, "idle": idle,
         "prefill": prefill, "dynamo": dynamo}[args.scenario](r, args.quick)
    except Exception as e:  # noqa: BLE001 -- every failure becomes a failed row
        r.row(f"{args.scenario}: the run finished", f"error: {e}"[:200], "finished", False)
        print(e, file=sys.stderr)
    finally:
        r.finish()
    sys.exit(0 if all(x["pass"] for x in r.rows) else 1)


if __name__ == "__main__":
    main()
