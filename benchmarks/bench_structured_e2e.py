"""Per-step cost of structured output through the engine (CPU): the same batch with and without grammars.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_structured_e2e.py [--batch 8] [--tokens 48]``.

Two checkpoints of the tiny K3 architecture (random weights), so only the vocabulary differs: the embedded one
(byte tokenizer, V = 272) and a K3-size one (V = 163,840: bench_grammar's synthetic byte-level BPE vocabulary
written as ``tiktoken.model`` with K3's special ids, so the worker loads it like a released checkpoint). For each,
a batch of ``--batch`` greedy requests decodes up to ``--tokens`` tokens: unconstrained (the peer: what the step
costs without grammars), then half or all of them under bench_grammar's constraints (JSON schema, JSON object,
regex, forced tool calls) and under a schema with a long ``pattern`` repetition. Reported per decode step:
wall time of ``EngineCore.step`` (context only: constrained requests that finish early shrink the batch) and the
worker's grammar timings (``StructuredSampling.timings``) per masked step: fill (accept + bitmask rows, on the
helper thread while the forward runs), wait (the sampler waiting for the fill after the forward: the part not
hidden), apply (mask -> logits, xgrammar's CPU kernel here; a device kernel on a GPU), confirm (gate steps of the
tokens the engine confirmed, main thread); their critical-path sum (confirm + wait + apply) is what the grammar
adds to a step. A new grammar's compile runs on a compile thread; when a request needs its mask before the
compile is done, the fill waits for it (shown separately and taken out of fill; a wait that long also shows in
the sampler's wait, spread over the run's masked steps). Floor: a step writes
``rows * V / 8`` bytes of mask. Measured, not asserted.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_grammar import CONSTRAINTS, K3_VOCAB, SyntheticTokenizer  # noqa: E402

import rocm_k3  # noqa: E402
from rocm_k3.model.tiny import write_tiny_checkpoint  # noqa: E402
from rocm_k3.sampling_params import SamplingParams  # noqa: E402
from rocm_k3.structured import StructuredOutputs  # noqa: E402
from rocm_k3.tokenizers import TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE  # noqa: E402

# bench_grammar's constraints (its fill/accept table is the per-row cost without the engine) plus a long pattern
LONG_PATTERN = StructuredOutputs(json={"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,200}$"}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"], "additionalProperties": False})


def k3_size_checkpoint(root: Path) -> Path:
    """The tiny model with a 163,840-id vocabulary and a synthetic tiktoken tokenizer (K3 special ids)."""
    tok = SyntheticTokenizer(K3_VOCAB)
    specials = {name: tid for name, tid in tok.special_tokens.items()}
    write_tiny_checkpoint(root, text_overrides={
        "vocab_size": K3_VOCAB, "bos_token_id": specials["[BOS]"], "pad_token_id": None,
        "eos_token_id": [specials["<|end_of_msg|>"], specials["[EOS]"]]})
    (root / TOKENIZER_FILE).unlink()
    lines = (f"{base64.b64encode(tok.token_bytes(i)).decode()} {i}" for i in range(tok.num_pieces))
    (root / TIKTOKEN_FILE).write_text("\n".join(lines) + "\n")
    named = {str(tid): {"content": name, "special": True} for name, tid in specials.items()
             if not name.startswith("<|reserved_token_")}
    (root / TOKENIZER_CONFIG_FILE).write_text(json.dumps({"added_tokens_decoder": named, "bos_token": "[BOS]",
                                                          "eos_token": "[EOS]"}))
    return root


def run(llm, params: list[SamplingParams]) -> dict:
    """Generate the batch, timing each engine step; returns decode-step means and the grammar timings."""
    core = llm.engine
    timings = core.executor.worker.structured.timings
    before = dict(vars(timings))
    steps: list[float] = []
    real = core.step

    def timed():
        t0 = time.perf_counter()
        out = real()
        steps.append(time.perf_counter() - t0)
        return out

    core.step = timed
    try:
        outs = llm.generate([f"request {i}: " for i in range(len(params))], params)
    finally:
        core.step = real
    delta = {k: getattr(timings, k) - before[k] for k in before}
    n = max(1, delta["steps"])  # steps with a mask
    ms = {k: 1e3 * delta[f"{k}_s"] / n for k in ("fill", "wait", "apply", "compile_wait")}
    ms["confirm"] = 1e3 * delta["confirm_s"] / len(steps)  # every step confirms (also the unmasked ones)
    ms["critical"] = ms["confirm"] + ms["wait"] + ms["apply"]  # what the grammar adds to a step's wall time
    return {"steps": len(steps), "step_ms": 1e3 * sum(steps[2:]) / max(1, len(steps) - 2), "masked": delta["steps"],
            "rows": delta["rows"] / n, "compile_ms": 1e3 * delta["compile_s"],
            "compile_wait_ms": 1e3 * delta["compile_wait_s"], **ms,
            "finished": sum(o.finish_reason == "stop" for o in outs)}


def bench(label: str, path: Path, args: argparse.Namespace) -> None:
    llm = rocm_k3.LLM(path, dtype="float32", max_model_len=1024, max_num_seqs=max(args.batch, 4))
    vocab = llm.vocab_size
    free = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def constrained(spec: StructuredOutputs) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=args.tokens, structured_outputs=spec)

    b = args.batch
    schema = constrained(CONSTRAINTS["json_schema"])
    cases = {"unconstrained (peer)": [free] * b, "half json_schema": [schema, free] * (b // 2),
             "all json_schema": [schema] * b, "all json_object": [constrained(CONSTRAINTS["json_object"])] * b,
             "all regex": [constrained(CONSTRAINTS["regex"])] * b,
             "all tools_required": [constrained(CONSTRAINTS["tools_required"])] * b,
             "all json, pattern {1,200}": [constrained(LONG_PATTERN)] * b}
    run(llm, [free] * 2)  # warm up
    print(f"\n## {label}: V = {vocab}, batch {b}, up to {args.tokens} tokens; mask floor {b * vocab / 8 / 1024:.1f} "
          "KiB/step")
    print("| batch | steps | step ms | rows/step | fill ms (thread) | wait ms | apply ms | confirm ms | grammar on "
          "the critical path ms/step (per row) | compile ms (total; waited) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, params in cases.items():
        r = run(llm, params)
        per_row = r["critical"] / r["rows"] if r["rows"] else 0.0
        print(f"| {name} | {r['steps']} | {r['step_ms']:.2f} | {r['rows']:.1f} | "
              f"{r['fill'] - r['compile_wait']:.3f} | {r['wait']:.3f} | {r['apply']:.3f} | "
              f"{r['confirm']:.3f} | {r['critical']:.3f} ({per_row:.3f}) | "
              f"{r['compile_ms']:.0f}; {r['compile_wait_ms']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--skip-k3", action="store_true", help="only the embedded vocabulary")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench("tiny (embedded byte tokenizer)", write_tiny_checkpoint(Path(tmp) / "tiny"), args)
        if not args.skip_k3:
            bench("K3-size (synthetic tiktoken vocabulary)", k3_size_checkpoint(Path(tmp) / "k3"), args)


if __name__ == "__main__":
    main()
