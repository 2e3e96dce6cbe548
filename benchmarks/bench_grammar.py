"""Per-step CPU cost of structured output: ``fill_bitmask`` + ``accept`` of rocm_k3's GrammarState (xgrammar).

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_grammar.py [--steps 256] [--json OUT]``.

Two vocabularies: a synthetic byte-level one of K3's size (163,840 ids: 256 bytes, 163,328 random BPE-like
pieces -- words with and without a leading space, digit runs, punctuation, whitespace runs, CJK -- and K3's 256
specials at 163,584..163,839) and a tiny one (256 bytes + 64 specials). For each constraint the script compiles
the grammar (cold, timed), then drives generations with seeded random logits masked by the grammar until
termination (restarting as needed) for ``--steps`` constrained steps, timing each ``fill_bitmask`` and each
``accept``; the gate's per-token cost while gated, and the cost of applying a bitmask to one row of fp32 logits
(xgrammar's CPU kernel and a torch reference) are timed too.

Peer: xgrammar's builtin JSON grammar driven by a bare ``xgrammar.GrammarMatcher`` (what a json_object request
costs in an engine that uses xgrammar directly), in the same run. Floor: one step must write V/32 int32 words
(V/8 bytes, 20 KiB at K3's size), a few microseconds of memory traffic; everything above it is grammar work.
This is measured, not asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import xgrammar as xgr

from rocm_k3.structured import StructuredCompiler, StructuredOutputs, allocate_bitmask, tool_call_constraint
from rocm_k3.structured.vocab import build_tokenizer_info, family_tokens

K3_SPECIALS = ("[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>")
K3_VOCAB = 163_840
NUM_SPECIALS = 256


class SyntheticTokenizer:
    """Byte-level vocabulary of ``vocab_size`` ids with the project's tokenizer interface (K3 specials last)."""

    def __init__(self, vocab_size: int, seed: int = 0, num_specials: int = NUM_SPECIALS) -> None:
        rng = random.Random(seed)
        n_pieces = vocab_size - num_specials
        if n_pieces < 256 or num_specials < len(K3_SPECIALS):
            raise ValueError(f"vocab_size {vocab_size}: need 256 byte ids and {len(K3_SPECIALS)} specials")
        pieces = [bytes([i]) for i in range(256)]
        seen = set(pieces)
        letters = "abcdefghijklmnopqrstuvwxyz"
        cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
        while len(pieces) < n_pieces:
            r = rng.random()
            if r < 0.70:
                word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
                word = word.capitalize() if rng.random() < 0.2 else word
                text = (" " + word) if rng.random() < 0.6 else word
            elif r < 0.80:
                text = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
            elif r < 0.90:
                text = "".join(rng.choice("{}[]()<>\"':;,.!?-_=+*/\\|&#@$%^~`") for _ in range(rng.randint(1, 4)))
            elif r < 0.95:
                text = rng.choice([" ", "\n", "\t"]) * rng.randint(2, 8)
            else:
                text = "".join(rng.choice(cjk) for _ in range(rng.randint(1, 3)))
            piece = text.encode()
            if piece not in seen:
                seen.add(piece)
                pieces.append(piece)
        self._pieces = pieces
        self.vocab_size = vocab_size
        self.num_pieces = n_pieces
        names = list(K3_SPECIALS) + [f"<|reserved_token_{n_pieces + i}|>" for i in range(len(K3_SPECIALS),
                                                                                          num_specials)]
        self.special_tokens: Mapping[str, int] = {name: n_pieces + i for i, name in enumerate(names)}
        self._text = {i: n for n, i in self.special_tokens.items()}
        self.eos_token_ids = (self.special_tokens["<|end_of_msg|>"], self.special_tokens["[EOS]"])

    def token_bytes(self, token_id: int) -> bytes:
        return self._text[token_id].encode() if token_id in self._text else self._pieces[token_id]

    def encode_marker(self, text: str) -> list[int]:
        out, pos = [], 0
        while pos < len(text):
            hit = next((n for n in K3_SPECIALS if text.startswith(n, pos)), None)
            if hit is not None:
                out.append(self.special_tokens[hit])
                pos += len(hit)
            else:
                out.append(text.encode()[pos] if text[pos].isascii() else 0)
                pos += 1
        return out


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}}, "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
             "required": ["query"]}}}]
CONSTRAINTS = {
    "json_schema": StructuredOutputs(json=SCHEMA),
    "json_object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=r"[A-Z][a-z]{2,12} [0-9]{1,4}(, [A-Z][a-z]+)*"),
    "choice": StructuredOutputs(choice=["positive", "negative", "neutral", "mixed feelings"]),
    "tools_required": StructuredOutputs(tools=tool_call_constraint(TOOLS, "required")),
}


def lone_high_bytes(tok: SyntheticTokenizer) -> list[int]:
    return [i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80]


def drive(new_matcher, fill, accept, is_terminated, vocab: int, steps: int, banned: list[int], seed: int):
    """Generate with random masked logits until ``steps`` constrained steps; returns fill and accept times (s)."""
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, vocab)
    fills, accepts, restarts = [], [], 0
    m = new_matcher()
    while len(fills) < steps:
        t0 = time.perf_counter()
        fill(m, bitmask)
        t1 = time.perf_counter()
        logits = torch.randn(1, vocab, generator=gen)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        logits[0, banned] = float("-inf")
        tok = int(logits.argmax())
        t2 = time.perf_counter()
        accept(m, tok)
        t3 = time.perf_counter()
        fills.append(t1 - t0)
        accepts.append(t3 - t2)
        if is_terminated(m):
            m = new_matcher()
            restarts += 1
    return fills, accepts, restarts


def us(values: list[float]) -> tuple[float, float, float]:
    qs = sorted(values)
    return (statistics.fmean(qs) * 1e6, qs[len(qs) // 2] * 1e6, qs[min(len(qs) - 1, int(len(qs) * 0.99))] * 1e6)


def bench_vocab(label: str, tok: SyntheticTokenizer, args: argparse.Namespace) -> list[dict]:
    rows = []
    t0 = time.perf_counter()
    compiler = StructuredCompiler(tok, "kimi_k3", max_threads=args.threads)
    setup_s = time.perf_counter() - t0
    banned = lone_high_bytes(tok)
    vocab = compiler.vocab_size
    print(f"\n## {label}: V = {vocab}, tokenizer info + compiler {setup_s * 1e3:.0f} ms, bitmask row "
          f"{(vocab + 31) // 32 * 4} B")
    for name, spec in CONSTRAINTS.items():
        t0 = time.perf_counter()
        compiler.compile(spec)
        compile_ms = (time.perf_counter() - t0) * 1e3
        fills, accepts, restarts = drive(
            lambda: compiler.new_state(spec, thinking=False), lambda s, bm: s.fill_bitmask(bm, 0),
            lambda s, t: s.accept(t), lambda s: s.is_terminated, vocab, args.steps, banned, args.seed)
        rows.append({"vocab": label, "grammar": name, "compile_ms": compile_ms, "fill_us": us(fills),
                     "accept_us": us(accepts), "restarts": restarts})
    # peer: xgrammar's builtin JSON grammar through a bare GrammarMatcher on the same vocabulary
    info = build_tokenizer_info(tok, family_tokens(tok, "kimi_k3"))
    peer = xgr.GrammarCompiler(info, max_threads=args.threads, cache_enabled=False)
    t0 = time.perf_counter()
    builtin = peer.compile_builtin_json_grammar()
    compile_ms = (time.perf_counter() - t0) * 1e3
    fills, accepts, restarts = drive(
        lambda: xgr.GrammarMatcher(builtin), lambda m, bm: m.fill_next_token_bitmask(bm, 0),
        lambda m, t: m.accept_token(t), lambda m: m.is_terminated(), vocab, args.steps, banned, args.seed)
    rows.append({"vocab": label, "grammar": "peer: xgrammar builtin JSON", "compile_ms": compile_ms,
                 "fill_us": us(fills), "accept_us": us(accepts), "restarts": restarts})
    # the gate while inside think: accept() of ordinary tokens, then of the think-close marker
    state = compiler.new_state(CONSTRAINTS["json_schema"], thinking=True)
    rng = random.Random(args.seed)
    think = [rng.randrange(0, 128) if tok.num_pieces == 256 else rng.randrange(256, tok.num_pieces)
             for _ in range(args.steps * 4)]
    t0 = time.perf_counter()
    for t in think:
        state.accept(t)
    gate_us = (time.perf_counter() - t0) / len(think) * 1e6
    for t in tok.encode_marker("<|close|>think<|sep|>"):
        state.accept(t)
    if state.is_gated:
        raise RuntimeError("the gate did not open at <|close|>think<|sep|>")
    # applying one row of the mask to fp32 logits: xgrammar's CPU kernel vs a torch reference
    bitmask = allocate_bitmask(1, vocab)
    state.fill_bitmask(bitmask, 0)
    logits = torch.randn(1, vocab)
    apply_xgr = timeit(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab), args.repeats)
    bits = torch.arange(32, dtype=torch.int32)

    def torch_apply() -> None:
        allowed = ((bitmask[0].repeat_interleave(32) >> bits.repeat(bitmask.shape[1])) & 1)[:vocab].bool()  # [V]
        logits.masked_fill_(~allowed[None], float("-inf"))

    apply_torch = timeit(torch_apply, args.repeats)
    print("| grammar | compile ms | fill us mean / p50 / p99 | accept us mean / p50 / p99 | fill+accept us | "
          "restarts |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        f, a = r["fill_us"], r["accept_us"]
        print(f"| {r['grammar']} | {r['compile_ms']:.1f} | {f[0]:.1f} / {f[1]:.1f} / {f[2]:.1f} | "
              f"{a[0]:.1f} / {a[1]:.1f} / {a[2]:.1f} | {f[0] + a[0]:.1f} | {r['restarts']} |")
    floor_us = (vocab + 31) // 32 * 4 / 10e9 * 1e6
    print(f"gate while thinking: {gate_us:.2f} us/token; apply one row: xgrammar CPU {apply_xgr * 1e6:.1f} us, "
          f"torch reference {apply_torch * 1e6:.1f} us; floor (write V/8 B at 10 GB/s) {floor_us:.2f} us")
    for r in rows:
        r.update(gate_us_per_token=gate_us, apply_xgr_us=apply_xgr * 1e6, apply_torch_us=apply_torch * 1e6)
    return rows


def timeit(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=256, help="constrained steps timed per grammar")
    p.add_argument("--repeats", type=int, default=50, help="repeats of the bitmask-apply timing")
    p.add_argument("--threads", type=int, default=1, help="xgrammar compile threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k3-vocab", type=int, default=K3_VOCAB)
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = bench_vocab("tiny", SyntheticTokenizer(256 + 64, args.seed, num_specials=64), args)
    rows += bench_vocab("K3-size", SyntheticTokenizer(args.k3_vocab, args.seed), args)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
