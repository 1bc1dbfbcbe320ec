#!/usr/bin/env python3
"""Drives the llguidance plugin's core Wasm module through its canonical-ABI exports.

Needs the `wasmtime` package (PyPI). Usage:
  wasm_drive.py MODULE.wasm            a small byte vocabulary: JSON schema, choice, rollback
  wasm_drive.py MODULE.wasm GGUF [N]   the GGUF's vocabulary (GPT-2 byte-level): time of
                                       each `next` export call over N tokens (default 200) of
                                       the tool-call walk of constraint-core's mask_bench example
"""
import json
import os
import struct
import sys
import time

import wasmtime

IFACE = "chimera:plugin/constraining@0.2.0#"


class Plugin:
    def __init__(self, path):
        self.engine = wasmtime.Engine()
        self.store = wasmtime.Store(self.engine)
        module = wasmtime.Module.from_file(self.engine, path)
        assert not module.imports, f"imports: {[i.name for i in module.imports]}"
        self.inst = wasmtime.Instance(self.store, module, [])
        ex = self.inst.exports(self.store)
        self.mem = ex["memory"]
        self.realloc = ex["cabi_realloc"]
        self.fns = {n: ex[IFACE + n] for n in ("init", "open", "next", "rollback", "close")}
        self.post = {n: ex["cabi_post_" + IFACE + n] for n in ("init", "open", "next", "rollback")}

    def _alloc(self, data, align=1):
        """Copies `data` into a fresh allocation; returns (pointer, length in elements of
        `align` bytes: the canonical ABI's list length for u8 and u32 lists)."""
        if not data:
            return align, 0
        ptr = self.realloc(self.store, 0, 0, align, len(data))
        self.mem.write(self.store, data, ptr)
        return ptr, len(data) // align

    def _u32(self, ptr):
        return struct.unpack("<I", self.mem.read(self.store, ptr, ptr + 4))[0]

    def _string(self, ptr):
        p, n = self._u32(ptr), self._u32(ptr + 4)
        return self.mem.read(self.store, p, p + n).decode()

    def _result(self, name, ret, ok):
        tag = self.mem.read(self.store, ret, ret + 1)[0]
        value = ok(ret + 4) if tag == 0 else self._string(ret + 4)
        self.post[name](self.store, ret)
        return (tag == 0, value)

    def init(self, tokens, special, eos):
        ends, total = [], 0
        for t in tokens:
            total += len(t)
            ends.append(total)
        b = self._alloc(b"".join(tokens))
        e = self._alloc(struct.pack(f"<{len(ends)}I", *ends), 4)
        s = self._alloc(bytes(special))
        ret = self.fns["init"](self.store, 4, 0, *b, *e, *s, eos)  # no config entries
        return self._result("init", ret, lambda p: None)

    def open(self, kind, grammar):
        k = self._alloc(kind.encode())
        g = self._alloc(grammar.encode())
        ret = self.fns["open"](self.store, *k, *g)
        return self._result("open", ret, self._u32)

    def next(self, matcher, tokens):
        t = self._alloc(struct.pack(f"<{len(tokens)}I", *tokens), 4)
        t0 = time.perf_counter()
        ret = self.fns["next"](self.store, matcher, *t)
        self.last_call_s = time.perf_counter() - t0

        def words(p):
            ptr, n = self._u32(p), self._u32(p + 4)
            return list(struct.unpack(f"<{n}I", self.mem.read(self.store, ptr, ptr + 4 * n)))

        return self._result("next", ret, words)

    def rollback(self, matcher, count):
        ret = self.fns["rollback"](self.store, matcher, count)
        return self._result("rollback", ret, lambda p: None)

    def close(self, matcher):
        self.fns["close"](self.store, matcher)


def allowed(mask, n):
    return [t for t in range(n) if mask[t // 32] >> (t % 32) & 1]


def small(path):
    tokens = [bytes([b]) for b in range(256)] + [b'{"', b'":', b"true", b"</s>"]
    special = [0] * (len(tokens) - 1) + [1]
    eos = len(tokens) - 1
    p = Plugin(path)
    assert p.init(tokens, special, eos) == (True, None)
    schema = json.dumps({
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"], "additionalProperties": False,
    })
    ok, m = p.open("json-schema", schema)
    assert ok, m
    # Longest allowed token that continues the target text.
    target, out, fed = b'{"ok":true,"n":42}', b"", []
    ok, mask = p.next(m, [])
    while out != target:
        assert ok, mask
        cands = [t for t in allowed(mask, len(tokens)) if t != eos and target[len(out):].startswith(tokens[t])]
        t = max(cands, key=lambda t: len(tokens[t]))
        out += tokens[t]
        fed.append(t)
        ok, mask = p.next(m, [t])
    assert ok and allowed(mask, len(tokens)) == [eos], mask
    assert p.rollback(m, 2) == (True, None)
    ok, mask = p.next(m, [])
    assert ok and ord("2") in allowed(mask, len(tokens))
    print("json-schema walk:", out.decode(), "tokens", fed)
    assert p.open("json-schema", "{nope")[0] is False
    print("bad schema error:", p.open("json-schema", "{nope")[1])
    ok, c = p.open("choice", '["yes", "no"]')
    ok, mask = p.next(c, [])
    print("choice first mask:", [tokens[t].decode() for t in allowed(mask, len(tokens))])
    assert p.next(c, [ord("x")])[0] is False
    p.close(c)
    print("unknown matcher:", p.next(c, []))
    print("wasm OK")


def gguf_vocabulary(path):
    """(tokens as bytes, special flags, eos) of a GGUF with a GPT-2 byte-level vocabulary."""
    data = open(path, "rb").read()
    assert data[:4] == b"GGUF"
    at = 24
    count = struct.unpack_from("<Q", data, 16)[0]
    sizes = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}

    def string(at):
        n = struct.unpack_from("<Q", data, at)[0]
        return data[at + 8 : at + 8 + n].decode("utf-8", "replace"), at + 8 + n

    def value(ty, at):
        if ty == 8:
            return string(at)
        if ty == 9:
            ety, n = struct.unpack_from("<IQ", data, at)
            at += 12
            out = []
            for _ in range(n):
                v, at = value(ety, at)
                out.append(v)
            return out, at
        size = sizes[ty]
        fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[size]
        if ty in (1, 3, 5, 11):
            fmt = fmt.lower()
        return struct.unpack_from(fmt, data, at)[0], at + size

    meta = {}
    for _ in range(count):
        key, at = string(at)
        ty = struct.unpack_from("<I", data, at)[0]
        v, at = value(ty, at + 4)
        meta[key] = v
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or b >= 174]
    decoder, extra = {}, 0
    for b in range(256):
        if b in printable:
            decoder[chr(b)] = b
        else:
            extra += 1
            decoder[chr(255 + extra)] = b
    tokens, special = [], []
    for tok, ty in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]):
        if ty == 3:
            tokens.append(tok.encode())
        else:
            tokens.append(b"".join(bytes([decoder[c]]) if c in decoder else c.encode() for c in tok))
        special.append(1 if ty == 3 else 0)
    return tokens, special, meta["tokenizer.ggml.eos_token_id"]


def bench(path, gguf, steps):
    examples = os.path.join(os.path.dirname(__file__), "../../constraint-core/examples")
    schema = open(os.path.join(examples, "tool_schema.json")).read()
    document = open(os.path.join(examples, "tool_call.json")).read().rstrip().encode()
    tokens, special, eos = gguf_vocabulary(gguf)
    p = Plugin(path)
    t0 = time.perf_counter()
    assert p.init(tokens, special, eos) == (True, None)
    print(f"vocabulary: {len(tokens)} tokens; init {1e3 * (time.perf_counter() - t0):.1f} ms")
    times, opens = [], []
    while len(times) < steps:
        t0 = time.perf_counter()
        ok, m = p.open("json-schema", schema)
        opens.append(time.perf_counter() - t0)
        assert ok, m
        rest, fed = document, []
        while True:
            ok, mask = p.next(m, fed)
            assert ok, mask
            if fed:
                times.append(p.last_call_s)
            if not rest or len(times) >= steps:
                break
            best = None
            for w, word in enumerate(mask):
                while word:
                    low = word & -word
                    t = w * 32 + low.bit_length() - 1
                    word ^= low
                    b = tokens[t]
                    if not special[t] and b and rest.startswith(b) and (best is None or len(b) > len(tokens[best])):
                        best = t
            assert best is not None, rest[:40]
            rest, fed = rest[len(tokens[best]):], [best]
        p.close(m)
    print(f"open (compile the schema): {1e3 * opens[0]:.2f} ms first, {1e3 * sum(opens) / len(opens):.2f} ms mean of {len(opens)}")
    times.sort()
    us = lambda s: f"{1e6 * s:.1f} us"
    print(
        f"next export call over {len(times)} tokens: mean {us(sum(times) / len(times))}, "
        f"p50 {us(times[len(times) // 2])}, p99 {us(times[round(0.99 * (len(times) - 1))])}, max {us(times[-1])}"
    )


def main():
    if len(sys.argv) == 2:
        small(sys.argv[1])
    else:
        bench(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 200)


if __name__ == "__main__":
    main()
