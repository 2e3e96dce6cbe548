"""``POST /v1/completions``: text (or token-id) prompts, n choices each, streamed as server-sent events or answered
whole. A batch of prompts gives ``len(prompts) * n`` choices, choice ``p * n + i`` being prompt p's i-th.

``echo`` puts the prompt before each choice's text (a stream sends it as the choice's first chunk); with
``logprobs`` the prompt tokens come first in the logprobs block, the first one's logprob null (OpenAI's and vLLM's
form), computed by the engine as prompt log-probabilities. ``echo`` with ``max_tokens: 0`` returns only the prompt
(how evaluation harnesses score a text): the engine runs the prompt and its one sampled token is dropped. vLLM's ``prompt_logprobs`` comes back on each choice."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from rocm_k3.engine.chat import response_format_constraint, structured_outputs_from
from rocm_k3.entrypoints.openai.errors import APIError, bad_request
from rocm_k3.entrypoints.openai.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from rocm_k3.entrypoints.openai.serving_common import (ChoiceState, ServedModel, choice_params, chunk_stream, collect,
    completion_logprobs, echo_logprobs, error_event, failed_choice, merge_streams, new_request_id, sampling_params, sse,
    start_streams, structured_outputs_of, usage, usage_every_chunk, vllm_prompt_logprobs)
from rocm_k3.sampling_params import SamplingParams


class CompletionRun:
    """One validated completions request, ready to run (see :func:`prepare_completion`)."""

    def __init__(self, served: ServedModel, req: CompletionRequest, model: str, prompts: list[list[int]],
                 params: SamplingParams, texts: list[str]) -> None:
        self.served, self.req, self.model = served, req, model
        self.prompts, self.texts = prompts, texts  # texts: each prompt as echoed
        self.params = choice_params(params, req.n)
        self.request_id = new_request_id("cmpl")
        self.n = req.n
        self.prompt_only = req.max_tokens == 0  # echo with max_tokens 0: the prompt alone

    async def _streams(self):
        engine_prompts = [p for p in self.prompts for _ in range(self.n)]
        engine_params = [self.params[i % self.n] for i in range(len(engine_prompts))]
        streams = await start_streams(self.served, self.request_id, engine_prompts, engine_params)
        self.served.metrics.prompt_tokens.inc(sum(len(p) for p in self.prompts) * self.n)
        return streams

    async def respond(self) -> CompletionResponse:
        """The whole response (the choices run concurrently on the engine)."""
        streams = await self._streams()
        choices = await collect(self.served, streams)
        out = []
        for i, c in enumerate(choices):
            self._drop_output(c)
            out.append(self._choice(i, c, c.text, c.token_ids, c.logprobs, c.finish_reason, head=True))
        return CompletionResponse(id=self.request_id, model=self.model, choices=out, usage=self._usage(choices),
                                  kv_transfer_params=choices[0].kv_transfer_params if choices else None)

    def _choice(self, i: int, c: ChoiceState, text: str, token_ids: list[int], entries, finish_reason: str | None,
                *, head: bool) -> CompletionChoice:
        """Choice ``i`` with ``text`` / ``token_ids`` (a stream chunk's, or the whole); ``head``: the choice's first
        piece, which carries the echoed prompt and the prompt logprobs."""
        k, prompt = self.params[0].logprobs, self.prompts[i // self.n]
        echo = head and self.req.echo
        lp = None
        if k is not None:
            offset = len(c.text) - len(text) + (len(self.texts[i // self.n]) if self.req.echo else 0)
            lp = completion_logprobs(self.served.tokenizer, token_ids, entries, k, offset) if entries else None
            if echo:
                lp = _joined(echo_logprobs(self.served.tokenizer, prompt, c.prompt_logprobs, k), lp)
        return CompletionChoice(
            index=i, text=self.texts[i // self.n] + text if echo else text, logprobs=lp, finish_reason=finish_reason,
            token_ids=token_ids if self.req.return_token_ids else None,
            prompt_token_ids=prompt if self.req.return_token_ids and head else None,
            prompt_logprobs=vllm_prompt_logprobs(self.served.tokenizer, prompt, c.prompt_logprobs, c.prompt_ranks,
                                                 self.req.prompt_logprobs) if head else None)

    def _drop_output(self, c: ChoiceState) -> None:
        """A prompt-only choice: nothing generated, finished by its length limit (0)."""
        if self.prompt_only:
            c.text, c.token_ids, c.logprobs = "", [], []
            c.finish_reason = "length" if c.finish_reason is not None else None

    def _usage(self, choices: list[ChoiceState]):
        cached = sum(c.cached for c in choices[:: self.n])
        return usage(sum(len(p) for p in self.prompts), sum(len(c.token_ids) for c in choices), cached)

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: one chunk per engine delta and choice, the usage chunk if asked, ``[DONE]``."""
        streams = await self._streams()
        return chunk_stream(self._events(streams), self.req, lambda: CompletionResponse(
            id=self.request_id, model=self.model, choices=[], usage=self._usage(self._choices)))

    async def _events(self, streams) -> AsyncIterator[str]:
        choices = self._choices = [ChoiceState() for _ in streams]
        timers = [self.served.metrics.timer() for _ in streams]
        started = [False] * len(streams)
        async for i, delta in merge_streams(streams):
            timers[i].on_delta(delta)
            c = choices[i]
            c.add(delta)
            if delta.finish_reason == "error":
                yield error_event(failed_choice(i, delta))
                continue
            if self.prompt_only:
                self._drop_output(c)
                delta = dataclasses.replace(delta, new_text="", new_token_ids=[], new_logprobs=None,
                                            finish_reason=c.finish_reason)
            head = not started[i] and (self.req.echo or self.req.prompt_logprobs is not None)
            wanted = head or (self.req.return_token_ids and delta.new_token_ids) or (
                self.params[0].logprobs is not None and delta.new_logprobs)
            if not delta.new_text and not delta.finished and not wanted:
                continue  # e.g. a token that is the first byte of a character still being completed
            started[i] = True
            choice = self._choice(i, c, delta.new_text, delta.new_token_ids, delta.new_logprobs,
                                  delta.finish_reason, head=head)
            running = self._usage(choices) if usage_every_chunk(self.req) else None
            yield sse(CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=running))


def prepare_completion(served: ServedModel, req: CompletionRequest) -> CompletionRun:
    """Check a completions request (404 / 400 / 503 raised here, before any output)."""
    model = served.check_model(req.model)
    served.check_alive()
    for name, bad in (("suffix", req.suffix is not None), ("best_of", req.best_of not in (None, 1, req.n))):
        if bad:
            raise APIError(400, f"{name}: not supported by this server", param=name)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed with stream=true", param="stream_options")
    prompts, texts = _prompt_ids(served, req.prompt)
    if req.max_tokens is None:
        max_tokens = max(1, served.max_model_len - max(len(p) for p in prompts) + 1)
    elif req.max_tokens == 0:
        if not req.echo:
            raise APIError(400, "max_tokens: 0 is only allowed with echo=true (the prompt alone); else expected an "
                           "int in [1, inf)", param="max_tokens")
        max_tokens = 1  # the engine samples one token, which the answer drops
    else:
        max_tokens = req.max_tokens
    try:
        constraint = response_format_constraint(req.response_format.as_dict() if req.response_format else None)
        extension = structured_outputs_from(structured_outputs_of(req))
        if constraint is not None and extension is not None:
            raise ValueError("structured_outputs: cannot be combined with a json response_format")
        constraint = constraint if constraint is not None else extension
        if constraint is not None:  # a completion's text is the value itself: no chat channel wrappers
            constraint = dataclasses.replace(constraint, bare=True)
    except (ValueError, TypeError) as exc:
        raise bad_request(exc) from None
    # echo with logprobs: the prompt tokens' logprobs too, with as many alternatives
    asked = [v for v in (req.prompt_logprobs, req.logprobs if req.echo else None) if v is not None]
    params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, skip_special_tokens=True,
                             structured_outputs=constraint, prompt_logprobs=max(asked) if asked else None)
    try:
        served.frontend.check_sampling(params)
    except (ValueError, TypeError) as exc:
        raise bad_request(exc) from None
    return CompletionRun(served, req, model, prompts, params, texts)


def _joined(head: CompletionLogprobs, tail: CompletionLogprobs | None) -> CompletionLogprobs:
    if tail is None:
        return head
    return CompletionLogprobs(tokens=head.tokens + tail.tokens, token_logprobs=head.token_logprobs + tail.token_logprobs,
                              top_logprobs=head.top_logprobs + tail.top_logprobs,
                              text_offset=head.text_offset + tail.text_offset)


def _prompt_ids(served: ServedModel, prompt) -> tuple[list[list[int]], list[str]]:
    """The prompt(s) as token-id lists, and as text (a string prompt as sent, ids decoded): a string, a list of
    strings, a list of ids or a list of id lists."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt: expected a non-empty prompt or list of prompts", param="prompt")
    out, texts = [], []
    for i, item in enumerate(items):
        field = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if served.tokenizer is None:
                raise APIError(400, f"{field}: this model has no tokenizer; send token ids", param=field)
            ids = served.tokenizer.encode(item)
        else:
            ids = list(item)
        if not ids:
            raise APIError(400, f"{field}: empty prompt", param=field)
        bad = [t for t in ids if not 0 <= t < served.vocab_size]
        if bad:
            raise APIError(400, f"{field}: token ids {bad[:8]} outside the vocabulary [0, {served.vocab_size})",
                           param=field)
        out.append(ids)
        texts.append(item if isinstance(item, str) else token_text_of(served.tokenizer, ids))
    return out, texts


def token_text_of(tokenizer, ids: list[int]) -> str:
    return "" if tokenizer is None else tokenizer.decode(ids)
