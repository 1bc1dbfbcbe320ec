#!/usr/bin/env python3
"""Drives the llguidance plugin's core Wasm module through its canonical-ABI exports.

Needs the `wasmtime` package (PyPI). Usage:
  wasm_drive.py MODULE.wasm            a small byte vocabulary: JSON schema, choice, rollback
  wasm_drive.py MODULE.wasm GGUF       the GGUF's vocabulary: per-token mask time of a tool
                                       schema walk (the same walk as the native example)
"""
import json
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
        ret = self.fns["next"](self.store, matcher, *t)

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


def main():
    if len(sys.argv) == 2:
        small(sys.argv[1])
    else:
        import gguf_bench

        gguf_bench.run(Plugin(sys.argv[1]), sys.argv[2])


if __name__ == "__main__":
    main()
