"""Remote images through the live server (``--allow-remote-images``) on the tiny vision K3: loopback, private and
link-local hosts refused with a 400 naming the host and the reason unless ``--allow-private-image-hosts``; slow
image hosts do not starve other requests (text-only and data: URL chats answer while 40 requests wait on a slow
host with a pool of 2), every slow request fails with a 400 after one ``--image-fetch-timeout``; oversized bodies
and redirect loops are 400s, on chat completions and the Responses API alike."""

from __future__ import annotations

import base64
import io
import threading
import time

import openai
import pytest

from rocm_k3.args import EngineArgs, ServerArgs
from rocm_k3.model.tiny import write_tiny_checkpoint
from tests.image_hosts import image_host, wait_until
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread for tiny matmuls)
from tests.server_fixtures import running_server
from tests.vision_engine_fixtures import noise_image

KNOBS = {"dtype": "float32", "block_size": 16, "match_unit": 8, "alignment": 16, "max_num_batched_tokens": 256,
         "max_num_seqs": 4, "max_model_len": 512}
SLOW_REQUESTS, WORKERS, TIMEOUT_S = 40, 2, 5.0


def _png() -> bytes:
    buf = io.BytesIO()
    noise_image(3, 56, 42).save(buf, format="PNG")
    return buf.getvalue()


def _chat(client, url: str | None, text: str = "Describe this."):
    content = [{"type": "text", "text": text}]
    if url is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4, temperature=0.0,
                                          messages=[{"role": "user", "content": content}],
                                          extra_body={"ignore_eos": True,
                                                      "chat_template_kwargs": {"thinking": False}})


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_vision_fetch"), seed=5, vision=True)


def test_private_hosts_are_refused_unless_allowed(vision_dir) -> None:
    args = ServerArgs(port=0, uvicorn_log_level="warning", allow_remote_images=True)
    with image_host(_png()) as host, running_server(EngineArgs(model=str(vision_dir), **KNOBS), args) as server:
        client = server.client()
        port = host.base.rsplit(":", 1)[1]
        for url, name, reason in [(host.url("/ok.png"), "127.0.0.1", "loopback"),
                                  (f"http://[::1]:{port}/ok.png", "::1", "loopback"),
                                  (f"http://[::ffff:127.0.0.1]:{port}/ok.png", "::ffff:127.0.0.1", "loopback"),
                                  ("http://10.0.0.1/cat.png", "10.0.0.1", "private"),
                                  ("http://169.254.169.254/latest/meta-data", "169.254.169.254", "link-local")]:
            with pytest.raises(openai.BadRequestError, match=rf"messages\[0\]\.content\[0\]: .*host '{name}' is "
                                                             rf"refused: .*{reason} address"):
                _chat(client, url)
        with pytest.raises(openai.BadRequestError, match="host '127.0.0.1' is refused"):
            client.responses.create(input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": host.url("/ok.png")}]}], max_output_tokens=2)
        assert host.connections == 0  # refused before connecting
        assert _chat(client, None).choices[0].finish_reason == "length"


def test_slow_image_hosts_do_not_starve_other_requests(vision_dir) -> None:
    args = ServerArgs(port=0, uvicorn_log_level="warning", allow_remote_images=True, allow_private_image_hosts=True,
                      image_fetch_workers=WORKERS, image_fetch_timeout=TIMEOUT_S, max_image_bytes=1 << 20)
    png = _png()
    with image_host(png) as host, running_server(EngineArgs(model=str(vision_dir), **KNOBS), args) as server:
        client = server.client()
        assert _chat(client, host.url("/ok.png")).choices[0].finish_reason == "length"  # fetched and served
        got = client.responses.create(input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": host.url("/hops/2")},
            {"type": "input_text", "text": "What is it?"}]}], max_output_tokens=2, temperature=0.0,
            extra_body={"ignore_eos": True})  # sampled or greedy, an early EOS would end it "completed"
        assert got.status == "incomplete" and got.usage.input_tokens > 20  # the image's block is in the prompt
        errors: list[str | None] = [None] * SLOW_REQUESTS
        ended = [0.0] * SLOW_REQUESTS

        def slow(i: int) -> None:
            try:
                _chat(client, host.url(f"/slow?{i}"))
                errors[i] = "answered"
            except openai.APIStatusError as exc:
                errors[i] = f"{exc.status_code} {exc.message}"
            ended[i] = time.monotonic()

        start = time.monotonic()
        threads = [threading.Thread(target=slow, args=(i,), daemon=True) for i in range(SLOW_REQUESTS)]
        for t in threads:
            t.start()
        wait_until(lambda: host.active >= WORKERS, 10, "the fetch pool to be busy with slow hosts")
        time.sleep(0.3)  # the rest of the slow requests are in the server, queued for the pool
        for url in (None, "data:image/png;base64," + base64.b64encode(png).decode()):
            asked = time.monotonic()
            assert _chat(client, url).choices[0].finish_reason == "length"
            answered = time.monotonic()
            assert answered - asked < 0.6 * TIMEOUT_S, f"a {'text' if url is None else 'data: URL'} request waited"
            assert not any(ended), "a slow request ended before the other requests were answered"
        for t in threads:
            t.join(3 * TIMEOUT_S)
        assert all(e is not None and e.startswith("400 ") and "--image-fetch-timeout" in e for e in errors), errors
        assert max(ended) - start < TIMEOUT_S + 4  # one deadline each, not 40 / 2 pool threads x TIMEOUT_S
        wait_until(lambda: host.active == 0, 3, "the slow fetches to hang up")
        for route, match in [("/huge-chunked", "larger than the limit of 1048576 bytes"),
                             ("/huge-declared", "Content-Length 1000000000"), ("/loop", "more than 3 redirects"),
                             (f"/to?url=http://0.0.0.0:{host.base.rsplit(':', 1)[1]}/ok.png", "unspecified address")]:
            with pytest.raises(openai.BadRequestError, match=match):
                _chat(client, host.url(route))
        assert host.sent < 64 * 2**20
