"""Images through ``LLM.chat`` and the server's chat API (``image_url`` parts) on the tiny vision K3, CPU, fp32:
the same tokens as ``LLM.generate`` with the same image, data: URLs taken, http(s) URLs refused unless the server
allows them (then fetched from a server on 127.0.0.1, with --allow-private-image-hosts, with a size limit; the
fetcher's own tests are tests/serve/test_image_fetch.py and test_server_image_fetch.py), bad images and image-less models named
with a 400, and different images never sharing prefix cache."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import pytest

import rocm_k3
from rocm_k3.args import EngineArgs, ServerArgs
from rocm_k3.model.tiny import write_tiny_checkpoint
from rocm_k3.sampling_params import SamplingParams
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.server_fixtures import running_server
from tests.vision_engine_fixtures import noise_image

KNOBS = {"dtype": "float32", "block_size": 16, "match_unit": 8, "alignment": 16, "max_num_batched_tokens": 256,
         "max_num_seqs": 4, "max_model_len": 512}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _png(seed: int, size: tuple[int, int] = (56, 42)) -> bytes:
    buf = io.BytesIO()
    noise_image(seed, *size).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _messages(url_or_image, text: str = "Describe this."):
    part = ({"type": "image_url", "image_url": {"url": url_or_image}} if isinstance(url_or_image, str)
            else {"type": "image", "image": url_or_image})
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_vision_chat"), seed=5, vision=True)


@pytest.fixture(scope="module")
def llm(vision_dir):
    return rocm_k3.LLM(vision_dir, **KNOBS)


def test_llm_chat_takes_image_parts_like_generate(llm) -> None:
    data = _png(1)
    by_url = llm.chat(_messages(_data_url(data)), GREEDY, chat_template_kwargs={"thinking": False})[0]
    by_image = llm.chat(_messages(noise_image(1, 56, 42)), GREEDY, chat_template_kwargs={"thinking": False})[0]
    assert by_url.output.token_ids == by_image.output.token_ids
    # the same computation through generate: the rendered ids with the image at the renderer's position
    prepared = llm.frontend.prepare_chat(
        rocm_k3.engine.chat.ChatRequest(_messages(_data_url(data)), chat_template_kwargs={"thinking": False}),
        allow_images=True)
    want = llm.generate({"prompt_token_ids": list(prepared.prompt_token_ids),
                         "image_positions": list(prepared.image_positions),
                         "multi_modal_data": {"image": data}}, GREEDY)[0]
    assert by_url.output.token_ids == want.token_ids
    other = llm.chat(_messages(_data_url(_png(2))), GREEDY, chat_template_kwargs={"thinking": False})[0]
    assert other.output.prompt_token_ids != by_url.output.prompt_token_ids or \
        other.output.token_ids != by_url.output.token_ids


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def image_host():
    _ImageHandler.body = _png(3)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/cat.png"
    finally:
        httpd.shutdown()
        thread.join(10)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=6,
                                          temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                                       "chat_template_kwargs": {"thinking": False}},
                                          **kw)


def test_server_chat_images(vision_dir, llm, image_host) -> None:
    import openai

    data = _png(1)
    want = llm.chat(_messages(_data_url(data)), GREEDY, chat_template_kwargs={"thinking": False})[0]
    with running_server(EngineArgs(model=str(vision_dir), **KNOBS)) as server:
        client = server.client()
        got = _chat(client, _messages(_data_url(data)))
        assert got.choices[0].model_extra["token_ids"] == want.output.token_ids
        assert got.model_extra["prompt_token_ids"] == want.output.prompt_token_ids
        assert got.usage.prompt_tokens == len(want.output.prompt_token_ids)
        stats = server.engine.stats()
        _chat(client, _messages(_data_url(_png(2))))  # same text, another image: no hit past the image
        after = server.engine.stats()
        assert after["hit_tokens"] - stats["hit_tokens"] < len(want.output.prompt_token_ids) - 8
        with pytest.raises(openai.BadRequestError, match="remote image URLs are refused"):
            _chat(client, _messages(image_host))
        with pytest.raises(openai.BadRequestError, match="not valid base64|not an image|image"):
            _chat(client, _messages("data:image/png;base64,bm90IGFuIGltYWdl"))
        with pytest.raises(openai.BadRequestError, match="unsupported image URL"):
            _chat(client, _messages("file:///etc/passwd"))
    allowed = ServerArgs(port=0, uvicorn_log_level="warning", allow_remote_images=True, max_image_bytes=1 << 20,
                         allow_private_image_hosts=True)  # the image host is on loopback
    with running_server(EngineArgs(model=str(vision_dir), **KNOBS), allowed) as server:
        client = server.client()
        remote = _chat(client, _messages(image_host))
        local = llm.chat(_messages(_data_url(_png(3))), GREEDY, chat_template_kwargs={"thinking": False})[0]
        assert remote.choices[0].model_extra["token_ids"] == local.output.token_ids
    small = ServerArgs(port=0, uvicorn_log_level="warning", allow_remote_images=True, max_image_bytes=1024,
                       allow_private_image_hosts=True)
    with running_server(EngineArgs(model=str(vision_dir), **KNOBS), small) as server:
        with pytest.raises(openai.BadRequestError, match="larger than the limit"):
            _chat(server.client(), _messages(image_host))


def test_a_text_model_refuses_images_with_a_400(tmp_path) -> None:
    import openai

    text_only = write_tiny_checkpoint(tmp_path / "text", seed=5)
    with running_server(EngineArgs(model=str(text_only), **KNOBS)) as server:
        with pytest.raises(openai.BadRequestError, match="takes no images"):
            _chat(server.client(), _messages(_data_url(_png(1))))
