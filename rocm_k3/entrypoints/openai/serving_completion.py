"""``POST /v1/completions``: text (or token-id) prompts, n choices each, streamed as server-sent events or answered
whole. A batch of prompts gives ``len(prompts) * n`` choices, choice ``p * n + i`` being prompt p's i-th."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from rocm_k3.engine.chat import response_format_constraint, structured_outputs_from
from rocm_k3.entrypoints.openai.errors import APIError, bad_request
from rocm_k3.entrypoints.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from rocm_k3.entrypoints.openai.serving_common import (
    SSE_DONE,
    ChoiceState,
    ServedModel,
    choice_params,
    collect,
    completion_logprobs,
    error_event,
    failed_choice,
    merge_streams,
    new_request_id,
    sampling_params,
    sse,
    start_streams,
    usage,
)
from rocm_k3.sampling_params import SamplingParams


class CompletionRun:
    """One validated completions request, ready to run (see :func:`prepare_completion`)."""

    def __init__(self, served: ServedModel, req: CompletionRequest, model: str, prompts: list[list[int]],
                 params: SamplingParams) -> None:
        self.served, self.req, self.model = served, req, model
        self.prompts = prompts
        self.params = choice_params(params, req.n)
        self.request_id = new_request_id("cmpl")
        self.n = req.n

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
            lp = None
            if self.params[0].logprobs is not None:
                lp = completion_logprobs(self.served.tokenizer, c.token_ids, c.logprobs, self.params[0].logprobs, 0)
            out.append(CompletionChoice(
                index=i, text=c.text, logprobs=lp, finish_reason=c.finish_reason,
                token_ids=c.token_ids if self.req.return_token_ids else None,
                prompt_token_ids=self.prompts[i // self.n] if self.req.return_token_ids else None))
        return CompletionResponse(id=self.request_id, model=self.model, choices=out, usage=self._usage(choices))

    def _usage(self, choices: list[ChoiceState]):
        cached = sum(c.cached for c in choices[:: self.n])
        return usage(sum(len(p) for p in self.prompts), sum(len(c.token_ids) for c in choices), cached)

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: one chunk per engine delta and choice, the usage chunk if asked, ``[DONE]``."""
        streams = await self._streams()
        return self._events(streams)

    async def _events(self, streams) -> AsyncIterator[str]:
        choices = [ChoiceState() for _ in streams]
        timers = [self.served.metrics.timer() for _ in streams]
        k = self.params[0].logprobs
        try:
            async for i, delta in merge_streams(streams):
                timers[i].on_delta(delta)
                c = choices[i]
                lp = None
                if k is not None and delta.new_logprobs:
                    lp = completion_logprobs(self.served.tokenizer, delta.new_token_ids, delta.new_logprobs, k,
                                             len(c.text))
                c.add(delta)
                if delta.finish_reason == "error":
                    yield error_event(failed_choice(i, delta))
                    continue
                ids_wanted = self.req.return_token_ids and delta.new_token_ids
                if not delta.new_text and not delta.finished and lp is None and not ids_wanted:
                    continue  # e.g. a token that is the first byte of a character still being completed
                choice = CompletionChoice(index=i, text=delta.new_text, logprobs=lp, finish_reason=delta.finish_reason,
                                          token_ids=delta.new_token_ids if self.req.return_token_ids else None)
                yield sse(CompletionResponse(id=self.request_id, model=self.model, choices=[choice]))
            opts = self.req.stream_options
            if opts is not None and opts.include_usage:
                yield sse(CompletionResponse(id=self.request_id, model=self.model, choices=[],
                                             usage=self._usage(choices)))
        except APIError as exc:
            yield error_event(exc)
        yield SSE_DONE


def prepare_completion(served: ServedModel, req: CompletionRequest) -> CompletionRun:
    """Check a completions request (404 / 400 / 503 raised here, before any output)."""
    model = served.check_model(req.model)
    served.check_alive()
    for name, bad in (("echo", req.echo), ("suffix", req.suffix is not None),
                      ("best_of", req.best_of not in (None, 1, req.n))):
        if bad:
            raise APIError(400, f"{name}: not supported by this server", param=name)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed with stream=true", param="stream_options")
    prompts = _prompt_ids(served, req.prompt)
    if req.max_tokens is None:
        max_tokens = max(1, served.max_model_len - max(len(p) for p in prompts) + 1)
    else:
        max_tokens = req.max_tokens
    try:
        constraint = response_format_constraint(req.response_format.as_dict() if req.response_format else None)
        extension = structured_outputs_from(*req.structured_request())
        if constraint is not None and extension is not None:
            raise ValueError("structured_outputs: cannot be combined with a json response_format")
        constraint = constraint if constraint is not None else extension
        if constraint is not None:  # a completion's text is the value itself: no chat channel wrappers
            constraint = dataclasses.replace(constraint, bare=True)
    except (ValueError, TypeError) as exc:
        raise bad_request(exc) from None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, skip_special_tokens=True,
                             structured_outputs=constraint)
    try:
        served.frontend.check_sampling(params)
    except (ValueError, TypeError) as exc:
        raise bad_request(exc) from None
    return CompletionRun(served, req, model, prompts, params)


def _prompt_ids(served: ServedModel, prompt) -> list[list[int]]:
    """The prompt(s) as token-id lists: a string, a list of strings, a list of ids or a list of id lists."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt: expected a non-empty prompt or list of prompts", param="prompt")
    out = []
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
    return out
