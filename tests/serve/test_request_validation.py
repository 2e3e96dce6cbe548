"""Requests are untrusted input: SamplingParams and the prompt forms ``LLM.generate`` takes.

Every bad value gets a ValueError / TypeError naming the field and what was expected; nothing is reinterpreted
(a ``bytes`` prompt is not a list of token ids, ``seed=-1`` is not 2**64 - 1, ``temperature=inf`` is not uniform
sampling). numpy / torch integers are token ids like Python ints.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from model_fixtures import one_thread  # noqa: F401 (autouse)

import rocm_k3
from rocm_k3.engine.llm import LLM
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.model.tiny import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return rocm_k3.LLM(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=1), dtype="float32")


# ---------------------------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": math.inf}, r"temperature: expected a number in \[0, 2\], got inf"),
    ({"temperature": -math.inf}, r"temperature: expected a number in \[0, 2\], got -inf"),
    ({"temperature": math.nan}, r"temperature: expected a number in \[0, 2\], got nan"),
    ({"temperature": 2.5}, r"temperature: expected a number in \[0, 2\], got 2.5"),
    ({"temperature": "0.7"}, r"temperature: expected a number, got '0.7' \(str\)"),
    ({"seed": -1}, r"seed: expected an int in \[0, 2\*\*63 - 1\] or None, got -1"),
    ({"seed": 2**63}, r"seed: expected an int in \[0, 2\*\*63 - 1\]"),
    ({"seed": 2**64 - 1}, r"seed: expected an int in \[0, 2\*\*63 - 1\]"),
    ({"seed": "7"}, r"seed: expected an int or None, got '7' \(str\)"),
    ({"top_p": "0.9"}, r"top_p: expected a number, got '0.9' \(str\)"),
    ({"top_p": math.nan}, r"top_p: expected a number in \(0, 1\], got nan"),
    ({"top_k": 2.0}, r"top_k: expected an int, got 2.0 \(float\)"),
    ({"top_k": True}, r"top_k: expected an int, got True \(bool\)"),
    ({"max_tokens": "16"}, r"max_tokens: expected an int, got '16' \(str\)"),
    ({"max_tokens": 16.0}, r"max_tokens: expected an int, got 16.0 \(float\)"),
    ({"logprobs": 1.5}, r"logprobs: expected an int or None, got 1.5 \(float\)"),
    ({"logprobs": "2"}, r"logprobs: expected an int or None, got '2' \(str\)"),
    ({"stop": 5}, r"stop: expected a string, a list of strings or None, got 5 \(int\)"),
    ({"stop": [b"END"]}, r"stop: expected non-empty strings, got \[b'END'\]"),
    ({"stop_token_ids": 7}, r"stop_token_ids: expected a list of ints or None, got 7 \(int\)"),
    ({"stop_token_ids": [1.0]}, r"stop_token_ids: expected non-negative ints, got \[1.0\]"),
], ids=lambda v: ",".join(f"{k}={val!r}" for k, val in v.items()) if isinstance(v, dict) else "")
def test_bad_sampling_params_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_seed_bounds_are_accepted() -> None:
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


def test_none_means_no_stop_strings_or_ids() -> None:
    p = SamplingParams(stop=None, stop_token_ids=None)
    assert p.stop == () and p.stop_token_ids == ()
    assert SamplingParams(stop="END").stop == ("END",)


def test_numpy_and_torch_scalars_are_accepted() -> None:
    p = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(5), seed=np.uint32(3),
                       max_tokens=torch.tensor(4).item(), stop_token_ids=np.array([1, 2]), logprobs=np.int8(1))
    assert (p.top_k, p.seed, p.max_tokens, p.stop_token_ids, p.logprobs) == (5, 3, 4, (1, 2), 1)
    assert type(p.top_k) is int and type(p.seed) is int and all(type(t) is int for t in p.stop_token_ids)
    assert type(p.temperature) is float and p.temperature == 0.5


# ----------------------------------------------------------------------------------------------------- prompts
@pytest.mark.parametrize("prompt", [b"Hello", bytearray(b"Hello"), memoryview(b"Hello"), [b"Hello"],
                                    ["Hello", b"World"]],
                         ids=["bytes", "bytearray", "memoryview", "list-of-bytes", "mixed"])
def test_bytes_prompt_is_refused(llm: LLM, prompt: object) -> None:
    with pytest.raises(TypeError, match=r"bytes.*decode it to a str or pass a list of token ids"):
        llm.generate(prompt, GREEDY)


def test_numpy_and_torch_token_ids(llm: LLM) -> None:
    ids = list(b"Hello")
    want = llm.generate(ids, GREEDY)[0].token_ids
    forms = [
        [np.int64(t) for t in ids], [np.uint8(t) for t in ids], np.array(ids, dtype=np.int64),
        np.array(ids, dtype=np.int32), torch.tensor(ids), torch.tensor(ids, dtype=torch.int32),
    ]
    for form in forms:
        out = llm.generate(form, GREEDY)[0]
        assert out.token_ids == want and out.prompt_token_ids == ids and all(type(t) is int for t in
                                                                             out.prompt_token_ids)
    many = llm.generate([np.array(ids), torch.tensor(ids), ids], GREEDY)
    assert [o.token_ids for o in many] == [want] * 3
    rows = llm.generate(np.array([ids, ids]), GREEDY)  # a 2-d array (or tensor) is one prompt per row
    assert [o.token_ids for o in rows] == [want] * 2


@pytest.mark.parametrize("prompt, match", [
    (np.array([1.0, 2.0]), r"prompts: expected integer token ids, got a numpy array of dtype float64"),
    (torch.tensor([1.0, 2.0]), r"prompts: expected integer token ids, got a torch tensor of dtype torch.float32"),
    ([np.array([1.5])], r"prompts\[0\]: expected integer token ids, got a numpy array of dtype float64"),
    (np.zeros((2, 2, 2), dtype=np.int64), r"prompts: expected a 1-d \(one prompt\) or 2-d \(a prompt per row\) "
                                          r"array of token ids, got shape \(2, 2, 2\)"),
    (np.array(5), r"prompts: expected a 1-d .* array of token ids, got shape \(\)"),
    ([np.array([[1, 2]])], r"prompts\[0\]: expected a 1-d array of token ids, got shape \(1, 2\)"),
    ([True, False], r"prompts\[0\]: expected a str or a list of int token ids, got bool"),
    ([[1, True]], r"prompts\[0\]: token ids must be ints, got True \(bool\) at position 1"),
    ([[1, 2.0]], r"prompts\[0\]: token ids must be ints, got 2.0 \(float\) at position 1"),
    (np.array([True, False]), r"expected integer token ids, got a numpy array of dtype bool"),
], ids=["np-float", "torch-float", "np-float-in-list", "np-3d", "np-0d", "np-2d-in-list", "bools", "bool-id",
        "float-id", "np-bool"])
def test_bad_token_id_forms_are_named(llm: LLM, prompt: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        llm.generate(prompt, GREEDY)


def test_out_of_vocabulary_numpy_id_is_named(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"token ids \[100000\] outside the vocabulary"):
        llm.generate(np.array([1, 100000]), GREEDY)
