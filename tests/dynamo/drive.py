"""Workloads for a Dynamo frontend in front of chimera workers, sent with the official `openai`
client; prints one JSON object with what every request got.

    drive.py URL multi-turn --conversations 6 --turns 4 --max-tokens 16 --seed 0
        Conversations in parallel, turns of one conversation in order: each turn's prompt is
        the whole conversation so far (a system prompt, then user and assistant messages), so
        a worker holding the previous turn can reuse it. Each conversation's system prompt is
        its own, unless --shared-system gives them all one.
    drive.py URL stream --requests 9 --max-tokens 3000
        Concurrent long streamed completions (EOS ignored); each ends as "ok" (tokens
        received, finish reason) or "error" (the message), with its duration.

Used by the Dynamo tests (host/dynamo/tests) and usable by hand against any frontend.
"""

import argparse
import json
import random
import sys
import threading
import time

import openai


def client(url, timeout):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def words(rng, n):
    vocab = ["alpha", "river", "stone", "cloud", "seven", "orbit", "maple", "quartz", "delta",
             "lumen", "harbor", "violet", "copper", "ember", "tundra", "nectar"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def multi_turn(args):
    c = client(args.url, args.timeout)
    model = c.models.list().data[0].id
    shared = words(random.Random(1234), args.system_words)
    results = [None] * args.conversations
    errors = []

    def conversation(i):
        rng = random.Random(args.seed * 1000 + i)
        # Without --shared-system, the conversation's own words come first: no two
        # conversations share a whole block.
        system = ("You are a careful assistant. " + shared if args.shared_system
                  else f"Conversation {i}: " + words(rng, args.system_words))
        messages = [{"role": "system", "content": system}]
        turns = []
        for t in range(args.turns):
            if t > 0 and args.think > 0:
                # The user reads the answer and types the next question: the worker's KV
                # events reach the router meanwhile, as they do between real turns.
                time.sleep(args.think)
            messages.append({"role": "user", "content": f"Question {t}: " + words(rng, args.user_words)})
            try:
                r = c.chat.completions.create(
                    model=model, messages=messages, max_tokens=args.max_tokens, temperature=0,
                )
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                errors.append(f"conversation {i} turn {t}: {e}")
                return
            details = r.usage.prompt_tokens_details
            turns.append({
                "prompt_tokens": r.usage.prompt_tokens,
                "completion_tokens": r.usage.completion_tokens,
                "cached_tokens": (details.cached_tokens if details else None),
            })
            messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        results[i] = turns

    threads = [threading.Thread(target=conversation, args=(i,)) for i in range(args.conversations)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"model": model, "conversations": results, "errors": errors}


def stream(args):
    c = client(args.url, args.timeout)
    model = c.models.list().data[0].id
    out = [None] * args.requests

    def one(i):
        start = time.monotonic()
        tokens = 0
        finish = None
        try:
            s = c.completions.create(
                model=model, prompt=f"request {i}: tell a long story", max_tokens=args.max_tokens,
                temperature=0, stream=True, extra_body={"ignore_eos": True},
            )
            for chunk in s:
                if chunk.choices:
                    if chunk.choices[0].text:
                        tokens += 1
                    finish = chunk.choices[0].finish_reason or finish
            out[i] = {"outcome": "ok", "chunks": tokens, "finish_reason": finish,
                      "seconds": time.monotonic() - start}
        except Exception as e:  # noqa: BLE001 - the outcome is the point
            out[i] = {"outcome": "error", "chunks": tokens, "error": str(e)[:300],
                      "seconds": time.monotonic() - start}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.requests)]
    for th in threads:
        th.start()
    print(json.dumps({"started": args.requests}), file=sys.stderr, flush=True)
    for th in threads:
        th.join()
    return {"model": model, "requests": out}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--timeout", type=float, default=120)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("multi-turn")
    m.add_argument("--conversations", type=int, default=6)
    m.add_argument("--turns", type=int, default=4)
    m.add_argument("--max-tokens", type=int, default=16)
    m.add_argument("--system-words", type=int, default=60)
    m.add_argument("--user-words", type=int, default=12)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--shared-system", action="store_true")
    m.add_argument("--think", type=float, default=0.0,
                   help="seconds between an answer and the next question of a conversation")
    s = sub.add_parser("stream")
    s.add_argument("--requests", type=int, default=9)
    s.add_argument("--max-tokens", type=int, default=3000)
    args = p.parse_args()
    result = multi_turn(args) if args.cmd == "multi-turn" else stream(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
