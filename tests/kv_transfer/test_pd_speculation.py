"""Speculative decoding on the decode instance of a prefill/decode pair (issue #33 composed with #34): a producer
prefills and publishes the prompt's MLA pages and KDA state, a consumer with ``--speculative-config`` loads them and
decodes speculatively (n-gram and the embedded drafter, whose first drafts come from the hidden states of the one
prompt token the consumer computes). Greedy tokens equal a plain engine's, drafts are accepted, and the consumer's
pools are whole afterwards. SocketConnector (NixlConnector's handoff is the same to the scheduler)."""

from __future__ import annotations

import pytest

from rocm_k3 import LLM, SamplingParams
from rocm_k3.spec_decode.config import EMBEDDED_DRAFTER
from tests.engine_fixtures import assert_pools_released, varied_prompts
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.pd_fixtures import free_port

GREEDY = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
KW = dict(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def plain_and_producer():
    plain = LLM(**KW)
    prod = LLM(kv_transfer_config={"kv_connector": "SocketConnector", "kv_role": "kv_producer",
                                   "kv_port": free_port()}, **KW)
    yield plain, prod
    plain.shutdown()
    prod.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_consumer_after_a_pd_handoff_gives_the_greedy_tokens(plain_and_producer, method):
    plain, prod = plain_and_producer
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = EMBEDDED_DRAFTER
    cons = LLM(kv_transfer_config={"kv_connector": "SocketConnector", "kv_role": "kv_consumer", "timeout_s": 5.0},
               speculative_config=spec, **KW)
    try:
        prompts = varied_prompts(plain.engine.vocab_size, 8)
        expected = [o.token_ids for o in plain.generate(prompts, SamplingParams(**GREEDY))]
        for i, ids in enumerate(prompts):  # the producer prefills; its output carries the handoff
            prod.engine.add_request(f"p{i}", ids, SamplingParams(temperature=0.0, max_tokens=1,
                                                                 kv_transfer_params={"do_remote_decode": True}))
        handoff = {r: o.kv_transfer_params for r, o in prod.engine.run_to_completion().items()}
        before = cons.stats()
        for i, ids in enumerate(prompts):  # all loaded and decoded together: verifications batch across them
            cons.engine.add_request(f"d{i}", ids, SamplingParams(**GREEDY, kv_transfer_params=handoff[f"p{i}"]))
        got = cons.engine.run_to_completion()
        after = cons.stats()
        assert [got[f"d{i}"].token_ids for i in range(len(prompts))] == expected
        assert after["kv_transfer_loaded"] - before["kv_transfer_loaded"] == len(prompts)
        assert after["kv_transfer_failures"] == 0
        # the consumer computed only each prompt's last token: the rest came over the connector
        assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompts)
        assert 0 < after["spec_num_accepted_tokens"] < after["spec_num_draft_tokens"], after
        assert_pools_released(after)
    finally:
        cons.shutdown()
