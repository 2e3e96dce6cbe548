"""Structured output through the engine on the tiny K3 model (random weights: only the grammar makes the output
valid): the grammar runs on the worker (bitmask per step, applied to the logits before sampling), starts after the
reasoning (or a thinking budget forces the think-close), survives preemptions and failed steps, fails only its
own request when it cannot be built, and never changes the tokens of unconstrained batch mates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

import rocm_k3
from rocm_k3.cache.config import CacheConfig
from rocm_k3.engine.config import EngineConfig
from rocm_k3.formats.parsers import kimi_k3, parse_output
from rocm_k3.model.loader import load_model
from rocm_k3.model.tiny import write_tiny_checkpoint
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.structured import StructuredOutputs
from rocm_k3.tokenizers import load_tokenizer
from tests.engine_fixtures import core_for
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["happy", "sad"]}},
    "required": ["name", "age"], "additionalProperties": False}
SMALL = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}, "n": {"type": "integer", "maximum": 9}},
         "required": ["mood", "n"], "additionalProperties": False}
GRAMMAR = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_structured"), seed=5)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return rocm_k3.LLM(tiny_dir, dtype="float32", max_model_len=1024)


def _params(spec: StructuredOutputs | None, seed: int | None, **kw) -> SamplingParams:
    temp = 0.0 if seed is None else 1.0
    return SamplingParams(temperature=temp, seed=seed, max_tokens=kw.pop("max_tokens", 300), structured_outputs=spec,
                          skip_special_tokens=False, **kw)


def _content(text: str, prompt_in_think: bool = False) -> str:
    return parse_output("kimi_k3", text, thinking=prompt_in_think, prompt_in_think=prompt_in_think).content or ""


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_json_schema_output_validates(llm, seed) -> None:
    out = llm.generate("Tell me about a person.", _params(StructuredOutputs(json=SCHEMA), seed))[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(_content(out.text)), SCHEMA)


def test_regex_choice_grammar_and_json_object(llm) -> None:
    specs = [StructuredOutputs(regex=r"[a-z]{2,5}-[0-9]{2}"), StructuredOutputs(choice=["yes", "no", "maybe so"]),
             StructuredOutputs(grammar=GRAMMAR), StructuredOutputs(json_object=True)]
    outs = llm.generate(["Pick one."] * 4, [_params(s, seed=7) for s in specs])
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    regex, choice, grammar, obj = (_content(o.text) for o in outs)
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", regex), regex
    assert choice in ("yes", "no", "maybe so")
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", grammar), grammar
    assert isinstance(json.loads(obj), dict)


def test_unconstrained_batch_mates_get_the_tokens_they_get_alone(llm) -> None:
    free = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)]
    prompts = ["first prompt", "a second, longer prompt"]
    alone = [llm.generate(p, s)[0].token_ids for p, s in zip(prompts, free)]
    constrained = [_params(StructuredOutputs(json=SCHEMA), 1), _params(StructuredOutputs(regex="[0-9]{3}"), None)]
    mixed = llm.generate(["x", prompts[0], "y", prompts[1]], [constrained[0], free[0], constrained[1], free[1]])
    assert [mixed[1].token_ids, mixed[3].token_ids] == alone
    assert re.fullmatch("[0-9]{3}", _content(mixed[2].text))


def test_thinking_budget_forces_the_think_close_then_the_grammar(llm) -> None:
    tok = llm.tokenizer
    close = tok.encode(kimi_k3.THINK_CLOSE, allow_special=True)
    for budget in (0, 3):
        p = _params(StructuredOutputs(json=SCHEMA), 4, prompt_in_think=True, thinking_token_budget=budget)
        out = llm.generate("Think, then answer.", p)[0]
        assert out.token_ids[budget:budget + len(close)] == close
        parsed = parse_output("kimi_k3", out.text, thinking=True, prompt_in_think=True)
        assert (parsed.reasoning or "") == tok.decode(out.token_ids[:budget])
        jsonschema.validate(json.loads(parsed.content), SCHEMA)
    # without a grammar the budget still ends the reasoning; with a budget past max_tokens nothing is forced
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_in_think=True, thinking_token_budget=2)
    assert llm.generate("Think.", free)[0].token_ids[2:2 + len(close)] == close
    long = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_in_think=True, thinking_token_budget=50)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert llm.generate("Think.", long)[0].token_ids == llm.generate("Think.", plain)[0].token_ids


def test_invalid_constraints_are_refused_before_queueing(llm) -> None:
    for spec, match in ((StructuredOutputs(regex="a(b"), "regex"), (StructuredOutputs(grammar="root ::= x"), "grammar"),
                        (StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "json")):
        with pytest.raises(ValueError, match=match):
            llm.generate("x", _params(spec, None))
    assert not llm.engine.has_unfinished()


def _small_core(tiny_dir, num_blocks: int):
    model = load_model(tiny_dir, dtype=torch.float32, progress=False)
    cache = CacheConfig(block_size=16, match_unit=8, alignment=16, kda_save_grid=1, num_blocks=num_blocks,
                        num_state_slots=24)
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=176, cache=cache)
    return core_for(model, config, tokenizer=load_tokenizer(tiny_dir), model_path=tiny_dir, output_family="kimi_k3")


def _run(core, requests):
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params)
    return {rid: out.token_ids for rid, out in core.run_to_completion().items()}


def test_grammars_survive_preemption(tiny_dir) -> None:
    tok = load_tokenizer(tiny_dir)
    spec = StructuredOutputs(json=SMALL)
    requests = [(f"r{i}", tok.encode(f"prompt number {i} " * 4), _params(spec, i)) for i in range(3)]
    requests.append(("free", tok.encode("free text"), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    roomy = _run(_small_core(tiny_dir, 80), requests)
    tight_core = _small_core(tiny_dir, 12)  # 4 requests of ~100 tokens need ~24 blocks of 16: preemptions
    tight = _run(tight_core, requests)
    assert tight_core.stats()["preemptions"] >= 1
    assert tight == roomy
    for rid, ids in tight.items():
        if rid != "free":
            jsonschema.validate(json.loads(_content(tok.decode(ids))), SMALL)


class _FailOnce:
    def __init__(self, model, fail_at: int) -> None:
        self.model, self.fail_at, self.calls = model, fail_at, 0
        self.cfg = model.cfg

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return self.model.forward(*args, **kwargs)


def test_a_failed_step_does_not_desynchronise_the_grammar(tiny_dir) -> None:
    tok = load_tokenizer(tiny_dir)
    requests = [("a", tok.encode("alpha"), _params(StructuredOutputs(json=SMALL), 2))]
    want = _run(_small_core(tiny_dir, 80), requests)
    core = _small_core(tiny_dir, 80)
    core.executor.worker.runner.model = _FailOnce(core.executor.worker.runner.model, fail_at=6)  # mid-decode
    core.add_request(*requests[0])
    done, failures = {}, 0
    while core.has_unfinished():
        try:
            done.update((d.request_id, d.output.token_ids) for d in core.step() if d.finished)
        except RuntimeError as err:
            assert "injected failure" in str(err)
            failures += 1
    assert failures == 1 and done == want


def test_a_grammar_the_worker_cannot_build_fails_only_its_request(tiny_dir) -> None:
    model = load_model(tiny_dir, dtype=torch.float32, progress=False)
    cache = CacheConfig(block_size=16, match_unit=8, alignment=16, kda_save_grid=1, num_blocks=40, num_state_slots=8)
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=200, cache=cache)
    core = core_for(model, config, output_family=None)  # no family, no tokenizer on the worker
    core.add_request("grammar", [1, 2, 3], _params(StructuredOutputs(regex="a+"), None))
    core.add_request("free", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    out = core.run_to_completion()
    assert out["grammar"].finish_reason == "error" and "structured output is unavailable" in out["grammar"].error
    assert out["free"].finish_reason == "length" and len(out["free"].token_ids) == 5
    assert core.stats()["free_blocks"] == core.stats()["num_blocks"]


def test_grammar_timings_are_recorded(llm) -> None:
    worker = llm.engine.executor.worker
    before = worker.structured.timings.rows
    llm.generate("x", _params(StructuredOutputs(regex="[a-c]{4}"), None))
    t = worker.structured.timings
    assert t.rows - before >= 4 and t.fill_s > 0 and t.apply_s > 0
