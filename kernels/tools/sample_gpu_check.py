#!/usr/bin/env python3
"""Runs sample.cu's kernels on a GPU through CuPy, checks them against a NumPy transcription of
the CPU reference (host/src/backend/cpu/sample.rs), then times the common shapes.

usage (on a machine with a GPU and CuPy): python3 kernels/tools/sample_gpu_check.py [--no-bench]

Checks, per case: candidate ids bit-identical, candidate logits bit-identical (NaN payloads
included), the penalised logits bit-identical in every row (unsampled rows untouched), lse within
1e-6 relative of an exact (f64) log-sum-exp (same NaN / inf), 0 where not wanted; outputs are
poisoned first and scratch is filled with garbage. Prints 'N passed, N failed'.

The launch planner is transcribed from sample.rs (`Geometry::new`): keep the two in step.
A development aid; the backend's parity tests are the real gate.
"""
import os
import re
import sys

import numpy as np
import cupy as cp

HERE = os.path.dirname(os.path.abspath(__file__))
SMEM_LIMIT = 48 * 1024 - 2048


def inline(path, seen):
    out = []
    for line in open(path):
        m = re.match(r'\s*#include\s+"([^"]+)"', line)
        if m:
            inc = os.path.join(os.path.dirname(path), m.group(1))
            if inc not in seen:
                seen.add(inc)
                out.append(inline(inc, seen))
            continue
        if line.strip() != "#pragma once":
            out.append(line)
    return "".join(out)


def plan(n, vocab, k):
    """(K, scratch bytes, [(entry, grid, block, smem, args)]) as sample.rs plans them."""
    K = max(1, min(k, vocab))
    pen = ["logits", "sample_rows", "rep", "pres", "freq", "want", "offs", "toks", "cnts"]
    if K <= 1024:
        chunk = min(4096 if n <= 16 else 8192, max(vocab, 1))
        parts = -(-vocab // chunk)
        cache = (parts + 1) * K * 8 <= SMEM_LIMIT
        scratch = [n * parts * K * 8, n * parts * 8]
        merge_smem = ((parts + 1) if cache else 1) * K * 8
        launches = [
            ("sample_chunk_topk", n * parts, 256, chunk * 4,
             pen + [vocab, chunk, parts, K, ("scratch", 0), ("scratch", 1)]),
            ("sample_merge", n, 512, merge_smem,
             ["logits", "sample_rows", "want", vocab, parts, K, int(cache), ("scratch", 0),
              ("scratch", 1), "cand_tokens", "cand_logits", "lse"]),
        ]
    else:
        smem = K * 8 <= SMEM_LIMIT
        scratch = []
        launches = [("sample_row_topk", n, 1024, K * 8 if smem else 0,
                     pen + [vocab, K, int(smem), "cand_tokens", "cand_logits", "lse"])]
    return K, scratch, launches


def order_keys(row):
    x = np.where(np.isnan(row), np.float32(-np.inf), row).astype(np.float32)
    b = x.view(np.uint32)
    asc = np.where((b >> 31) == 1, ~b, b | np.uint32(0x80000000)).astype(np.uint32)
    return ((~asc).astype(np.uint64) << np.uint64(32)) | np.arange(len(row), dtype=np.uint64)


def reference(logits, case):
    """The CPU tail on a copy of `logits` (penalised in place, as the device does)."""
    out = logits.copy()
    vocab = out.shape[1]
    n = len(case["sample_rows"])
    K = max(1, min(case["k"], vocab))
    toks_all, cnts_all, offs = case["toks"], case["cnts"], case["offs"]
    cand_t = np.zeros((n, K), np.uint32)
    cand_l = np.zeros((n, K), np.float32)
    lse = np.zeros(n, np.float64)
    for i in range(n):
        row = out[case["sample_rows"][i]]
        r, p, f = case["rep"][i], case["pres"][i], case["freq"][i]
        rep_on = r != 1 and r > 0
        pf_on = p != 0 or f != 0
        if rep_on or pf_on:
            t = toks_all[offs[i]:offs[i + 1]]
            c = cnts_all[offs[i]:offs[i + 1]]
            keep = t < vocab
            t, c = t[keep], c[keep]
            x = row[t]
            if rep_on:
                x = np.where(x > 0, x / r, x * r).astype(np.float32)
            if pf_on:
                sel = c > 0
                x[sel] = x[sel] - (f * c[sel].astype(np.float32) + p)
            row[t] = x
        keys = np.sort(order_keys(row))[:K]
        cand_t[i] = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        cand_l[i] = row[cand_t[i]]
        if case["want"][i]:
            m = np.fmax.reduce(row, initial=-np.inf)
            if not np.isfinite(m):
                lse[i] = m
            elif np.isnan(row).any():
                lse[i] = np.nan
            else:
                lse[i] = float(m) + np.log(np.exp(row.astype(np.float64) - float(m)).sum())
    return out, cand_t, cand_l, lse


def make_row(rng, kind, vocab):
    if kind == "normal":
        return rng.normal(0, 3, vocab).astype(np.float32)
    if kind == "ties":
        return (rng.integers(0, 6, vocab) * 0.5).astype(np.float32)
    if kind == "specials":
        x = (rng.integers(0, 7, vocab) * 0.25 - 1).astype(np.float32)
        sp = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
        pos = rng.random(vocab) < 0.2
        x[pos] = sp[rng.integers(0, len(sp), pos.sum())]
        # A NaN with a payload, kept as it is in cand_logits.
        x[rng.integers(0, vocab)] = np.array([0x7fc0beef], np.uint32).view(np.float32)[0]
        return x
    if kind == "neg_inf_nan":
        x = np.full(vocab, -np.inf, np.float32)
        x[rng.random(vocab) < 0.3] = np.nan
        return x
    if kind == "equal":
        return np.full(vocab, 1.5, np.float32)
    if kind == "nan":
        return np.full(vocab, np.nan, np.float32)
    if kind == "neg_inf":
        return np.full(vocab, -np.inf, np.float32)
    raise ValueError(kind)


KINDS = ["normal", "ties", "specials", "neg_inf_nan", "equal", "nan", "neg_inf"]


def make_case(rng, n, rows, vocab, k, kinds=KINDS, hist=64):
    logits = np.stack([make_row(rng, kinds[r % len(kinds)], vocab) for r in range(rows)])
    sample_rows = rng.permutation(rows)[:n].astype(np.uint32)
    reps = np.array([1.0, 1.3, 0.7, 0.0, -1.0, np.nan], np.float32)
    rep = reps[rng.integers(0, len(reps), n)]
    pres = np.where(rng.random(n) < 0.5, 0, 0.5).astype(np.float32)
    freq = np.where(rng.random(n) < 0.5, 0, 0.2).astype(np.float32)
    want = (rng.random(n) < 0.7).astype(np.uint32)
    offs, toks, cnts = [0], [], []
    for _ in range(n):
        h = int(rng.integers(0, hist + 1))
        t = rng.choice(vocab + 16, size=min(h, vocab + 16), replace=False)  # some >= vocab
        toks.extend(t.tolist())
        cnts.extend(rng.integers(0, 4, len(t)).tolist())
        offs.append(len(toks))
    return dict(logits=logits, sample_rows=sample_rows, rep=rep, pres=pres, freq=freq,
                want=want, offs=np.array(offs, np.uint32), toks=np.array(toks, np.uint32),
                cnts=np.array(cnts, np.uint32), k=k)


class Device:
    def __init__(self):
        src = inline(os.path.join(HERE, "..", "src", "sample.cu"), set())
        self.mod = cp.RawModule(code=src, options=("-std=c++17",))
        self.fns = {}

    def fn(self, name):
        if name not in self.fns:
            self.fns[name] = self.mod.get_function(name)
        return self.fns[name]

    def prepare(self, case):
        n, vocab = len(case["sample_rows"]), case["logits"].shape[1]
        K, scratch, launches = plan(n, vocab, case["k"])
        buf = {name: cp.asarray(case[name]) for name in
               ["logits", "sample_rows", "rep", "pres", "freq", "want", "offs", "toks", "cnts"]}
        if buf["toks"].size == 0:
            buf["toks"] = cp.zeros(1, cp.uint32)
            buf["cnts"] = cp.zeros(1, cp.uint32)
        buf["cand_tokens"] = cp.full((n, K), 0xDEADBEEF, cp.uint32)
        buf["cand_logits"] = cp.full((n, K), 0x7fc0dead, cp.uint32).view(cp.float32)
        buf["lse"] = cp.full(n, 0x7fc0dead, cp.uint32).view(cp.float32)
        garbage = [cp.asarray(np.random.default_rng(1).integers(0, 256, max(b, 8), np.uint8))
                   for b in scratch]
        calls = []
        for entry, grid, block, smem, args in launches:
            a = []
            for x in args:
                if isinstance(x, str):
                    a.append(buf[x])
                elif isinstance(x, tuple):
                    a.append(garbage[x[1]])
                else:
                    a.append(np.uint32(x))
            calls.append((self.fn(entry), (grid,), (block,), smem, tuple(a)))
        return K, buf, calls

    @staticmethod
    def launch(calls):
        for f, grid, block, smem, args in calls:
            f(grid, block, args, shared_mem=smem)


def check(dev, name, case):
    K, buf, calls = dev.prepare(case)
    dev.launch(calls)
    cp.cuda.runtime.deviceSynchronize()
    ref_logits, ref_t, ref_l, ref_lse = reference(case["logits"], case)
    got_logits = cp.asnumpy(buf["logits"])
    got_t, got_l = cp.asnumpy(buf["cand_tokens"]), cp.asnumpy(buf["cand_logits"])
    got_lse = cp.asnumpy(buf["lse"]).astype(np.float64)
    errs = []
    if not np.array_equal(got_logits.view(np.uint32), ref_logits.view(np.uint32)):
        bad = np.argwhere(got_logits.view(np.uint32) != ref_logits.view(np.uint32))
        errs.append(f"penalised logits differ at {len(bad)} places, first {bad[:3].tolist()}")
    if not np.array_equal(got_t, ref_t):
        bad = np.argwhere(got_t != ref_t)
        r, c = bad[0]
        errs.append(f"tokens differ at {len(bad)} places, first [{r},{c}]: "
                    f"{got_t[r, c]:#x} vs {ref_t[r, c]:#x}")
    if not np.array_equal(got_l.view(np.uint32), ref_l.view(np.uint32)):
        errs.append("candidate logits differ")
    for i in range(len(ref_lse)):
        a, b = got_lse[i], ref_lse[i]
        if not case["want"][i]:
            ok = a == 0 and not np.signbit(a)
        elif np.isnan(b) or np.isinf(b):
            ok = (np.isnan(a) and np.isnan(b)) or a == b
        else:
            ok = abs(a - b) <= 1e-6 * max(abs(b), 1e-30) + 1e-7
        if not ok:
            errs.append(f"lse[{i}] {a!r} vs {b!r}")
            break
    print(("ok   " if not errs else "FAIL ") + name + ("" if not errs else ": " + "; ".join(errs)))
    sys.stdout.flush()
    return not errs


def bench(dev, rng, n, vocab, k, iters=200):
    case = make_case(rng, n, n, vocab, k, kinds=["normal"], hist=32)
    case["want"][:] = 1
    _, buf, calls = dev.prepare(case)
    for _ in range(10):
        dev.launch(calls)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
        dev.launch(calls)
    stop.record()
    stop.synchronize()
    us = cp.cuda.get_elapsed_time(start, stop) * 1000 / iters
    # The same sequence as a CUDA graph (launch gaps mostly gone), as the backend will run it.
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        dev.launch(calls)
        graph = stream.end_capture()
        for _ in range(10):
            graph.launch(stream)
        start.record(stream)
        for _ in range(iters):
            graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
    gus = cp.cuda.get_elapsed_time(start, stop) * 1000 / iters
    gb = n * vocab * 4 / 1e9
    print(f"bench n={n} vocab={vocab} k={k} want_lse=1: {us:.1f} us/step streamed, "
          f"{gus:.1f} us/step as a graph ({gb / (gus * 1e-6):.0f} GB/s of logits); "
          f"plan {[(e, g, s) for e, g, _, s, _ in plan(n, vocab, k)[2]]}")


def main():
    rng = np.random.default_rng(7)
    dev = Device()
    shapes = [  # (n, logits rows, vocab, k)
        (1, 1, 131072, 64), (3, 5, 50257, 64), (4, 4, 512, 1), (7, 7, 512, 512),
        (2, 2, 1000, 1007), (5, 9, 32000, 100), (7, 7, 131072, 1024), (7, 7, 8193, 1025),
        (7, 7, 20000, 6000), (7, 7, 4097, 4097), (3, 3, 3, 64), (1, 1, 1, 5),
        (17, 20, 8193, 64), (16, 16, 151936, 2), (64, 64, 4096, 4096), (256, 256, 131072, 64),
    ]
    passed = failed = 0
    for n, rows, vocab, k in shapes:
        for seed in range(2):
            case = make_case(rng, n, rows, vocab, k)
            ok = check(dev, f"n={n} rows={rows} vocab={vocab} k={k} #{seed}", case)
            passed += ok
            failed += not ok
    if "--no-bench" not in sys.argv:
        for n, vocab, k in [(1, 131072, 64), (8, 131072, 64), (256, 131072, 64),
                            (256, 151936, 64), (64, 131072, 1024), (4, 131072, 4096)]:
            bench(dev, rng, n, vocab, k)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
