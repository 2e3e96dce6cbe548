"""``rocm-k3 train-tiny-drafter DIR``: train the hidden-state drafter of the embedded tiny K3 on its own outputs.

1. Prompts from the text the embedded model was trained on (:mod:`rocm_k3.training.corpus`'s sources): generated
   K3 XTML chats (:func:`~rocm_k3.training.chats.make_chat`, rendered up to the first assistant turn) and short
   openings of standard-library prose paragraphs.
2. The target (served through ``rocm_k3.LLM``, fp32 reference ops) continues each prompt: greedily, or sampled at
   temperature 0.8 with a per-prompt seed (``sampled_fraction`` of them).
3. The target runs each whole sequence once more as a prefill with the drafter's depths tapped at every position
   (the serving forward, so training sees exactly the states serving will).
4. The drafter (:class:`~rocm_k3.spec_decode.drafter.TapDrafter`) learns, teacher-forced, to predict the target's
   tokens t+2 .. t+unroll+1 from position t's taps and tokens t+1 .. t+unroll, over the generated part of each
   sequence (Adam, cross-entropy, seeded batches).
5. It is written in bf16 (``config.json`` + ``model.safetensors``) and, with ``measure``, served with the target
   on :func:`acceptance_prompts` to report the mean accepted tokens per step.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rocm_k3.checks import check_int
from rocm_k3.formats.k3_chat import K3ChatRenderer
from rocm_k3.model.tiny import ensure_embedded_model
from rocm_k3.sampling_params import SamplingParams
from rocm_k3.spec_decode.drafter import DrafterConfig, TapDrafter, save_drafter
from rocm_k3.tokenizers.byte import embedded_byte_tokenizer
from rocm_k3.training.chats import make_chat
from rocm_k3.training.prose import prose_documents, stdlib_docstrings
from rocm_k3.worker.kv_pools import KVPools, PoolShapes
from rocm_k3.worker.model_runner import ModelRunner
from rocm_k3.worker.step_io import ScheduledChunk, StepInput

REPORT_FILE = "training.json"
SAMPLED_TEMPERATURE = 0.8


@dataclasses.dataclass(frozen=True)
class DrafterRecipe:
    """How a drafter is trained: the target's outputs it learns from, the optimiser and the drafter's shape."""

    seed: int = 0  # prompts, sampling seeds, initialisation and batches
    prompts: int = 256  # how many (half chats, half prose)
    max_new_tokens: int = 96  # target tokens generated per prompt
    sampled_fraction: float = 0.5  # share of prompts continued by sampling (the rest greedily)
    steps: int = 1500  # optimiser steps
    batch: int = 256  # examples per step
    lr: float = 3e-3
    unroll: int = 6  # drafted positions trained per example
    hidden_size: int = 96  # the drafter's width
    tap_layer_ids: tuple[int, ...] = (2, 4, 6)  # the target layers whose hidden states it reads
    threads: int = 2  # torch CPU threads

    def __post_init__(self) -> None:
        for name in ("prompts", "max_new_tokens", "steps", "batch", "unroll", "hidden_size", "threads"):
            check_int(name, getattr(self, name))
        if not 0 <= self.sampled_fraction <= 1:
            raise ValueError(f"sampled_fraction: expected a number in [0, 1], got {self.sampled_fraction!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected a positive number, got {self.lr!r}")


def drafter_prompts(count: int, seed: int) -> list[list[int]]:
    """``count`` prompts (token ids): chats rendered up to their first assistant turn, and prose openings."""
    tokenizer = embedded_byte_tokenizer()
    renderer = K3ChatRenderer(tokenizer)
    rng = random.Random(f"drafter-prompts-{seed}")
    paragraphs = [d.text for d in prose_documents(stdlib_docstrings())]
    out = []
    for i in range(count):
        if i % 2 == 0:
            chat = make_chat(rng)
            first = next(k for k, m in enumerate(chat.messages) if m["role"] == "assistant")
            out.append(renderer.render(list(chat.messages[:first]), add_generation_prompt=True,
                                       **chat.render_kwargs()).token_ids)
        else:
            words = rng.choice(paragraphs).split()
            out.append(tokenizer.encode(" ".join(words[: rng.randint(1, 6)])))
    return out


def acceptance_prompts() -> list[list[int]]:
    """The fixed prompt set the shipped drafter's acceptance is measured on (a seed training never uses)."""
    return drafter_prompts(12, seed=10_000)


def target_sequences(llm: Any, prompts: Sequence[list[int]], recipe: DrafterRecipe) -> list[tuple[list[int], int]]:
    """(prompt + the target's continuation, prompt length) per prompt."""
    rng = random.Random(f"drafter-sampling-{recipe.seed}")
    params = []
    for i in range(len(prompts)):
        sampled = rng.random() < recipe.sampled_fraction
        params.append(SamplingParams(temperature=SAMPLED_TEMPERATURE if sampled else 0.0,
                                     max_tokens=recipe.max_new_tokens, seed=recipe.seed * 100_003 + i))
    outs = llm.generate([list(p) for p in prompts], params)
    return [(list(p) + list(o.token_ids), len(p)) for p, o in zip(prompts, outs)]


@torch.inference_mode()
def tapped_states(model, seqs: Sequence[list[int]], tap_layer_ids: tuple[int, ...],
                  block_size: int = 64) -> list[torch.Tensor]:
    """The target's tapped hidden states at every position of each sequence, fp32 [len, taps, hidden] each (one
    prefill per sequence through the serving runner)."""
    longest = max(len(s) for s in seqs)
    blocks = -(-longest // block_size)
    pools = KVPools(PoolShapes.from_model(model, model.dtype), block_size=block_size, num_blocks=blocks, num_slots=1,
                    device=model.device)
    runner = ModelRunner(model, pools, blocks)
    previous = model.tap_layers
    model.tap_layers = tap_layer_ids
    out = []
    try:
        for i, ids in enumerate(seqs):
            chunk = ScheduledChunk(request_id=f"seq{i}", token_ids=tuple(ids), start=0, admitted=True,
                                   block_ids=tuple(range(-(-len(ids) // block_size))), kda_slot=0, is_prefill=True,
                                   sample=True)
            step = StepInput(step_id=i + 1, chunks=(chunk,), finished_request_ids=(f"seq{i - 1}",) if i else ())
            runner.apply_deltas(step)
            plan = dataclasses.replace(runner.plan(step), logits_indices=np.arange(len(ids), dtype=np.int64))
            model.forward(runner.batch(plan), pools)
            out.append(model.tapped.float().cpu())
    finally:
        model.tap_layers = previous
    return out


def training_examples(seqs: Sequence[tuple[list[int], int]], taps: Sequence[torch.Tensor],
                      unroll: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(taps [N, taps, hidden], inputs int64 [N, unroll], targets int64 [N, unroll], -100 past the end): one
    example per position t from the prompt's last token on whose token t+2 exists."""
    all_taps, inputs, targets = [], [], []
    for (ids, prompt_len), t_taps in zip(seqs, taps):
        n = len(ids)
        padded = torch.tensor(ids + [-100] * (unroll + 1), dtype=torch.int64)
        starts = torch.arange(prompt_len - 1, n - 2)
        if starts.numel() == 0:
            continue
        window = starts[:, None] + torch.arange(unroll)[None]
        all_taps.append(t_taps[starts])
        inputs.append(padded[window + 1].clamp(min=0))
        targets.append(padded[window + 2])
    return torch.cat(all_taps), torch.cat(inputs), torch.cat(targets)


def fit_drafter(cfg: DrafterConfig, taps: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor,
                recipe: DrafterRecipe, log: Callable[[str], None] = print) -> tuple[TapDrafter, list[float]]:
    """Train a seeded drafter on the examples; (drafter, loss per step)."""
    torch.manual_seed(recipe.seed)
    drafter = TapDrafter(cfg)
    opt = torch.optim.Adam(drafter.parameters(), lr=recipe.lr)
    gen = torch.Generator().manual_seed(recipe.seed)
    losses = []
    for step in range(recipe.steps):
        lr = recipe.lr * 0.5 * (1 + np.cos(np.pi * step / recipe.steps))  # cosine decay
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, taps.shape[0], (recipe.batch,), generator=gen)
        logits = drafter(taps[idx], inputs[idx])  # [B, unroll, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), targets[idx].flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % max(1, recipe.steps // 10) == 0 or step == recipe.steps - 1:
            log(f"step {step}: loss {loss.item():.3f}")
    return drafter.eval(), losses


def measure_acceptance(target: str | Path, drafter_dir: str | Path, k: int = 3,
                       prompts: Sequence[list[int]] | None = None, max_tokens: int = 48) -> dict[str, float]:
    """Greedy decoding of ``prompts`` (default :func:`acceptance_prompts`) with the drafter: the spec stats."""
    from rocm_k3.engine.llm import LLM

    llm = LLM(target, dtype="float32", backend="reference", speculative_config={
        "method": "draft_model", "model": str(drafter_dir), "num_speculative_tokens": k})
    llm.generate(list(prompts or acceptance_prompts()), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return {name: value for name, value in llm.stats().items() if name.startswith("spec_")}


def train_tiny_drafter(directory: str | Path, recipe: DrafterRecipe = DrafterRecipe(),
                       log: Callable[[str], None] = print, measure: bool = True,
                       target: str | Path | None = None) -> dict[str, Any]:
    """Train, write the drafter to ``directory`` and return the report (also in its ``training.json``).

    target: the checkpoint to draft for (default: the embedded tiny K3)."""
    from rocm_k3.engine.llm import LLM

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        started = time.perf_counter()
        target = Path(target) if target is not None else ensure_embedded_model()
        llm = LLM(target, dtype="float32", backend="reference", max_num_seqs=32)
        model_cfg = llm.model.cfg
        cfg = DrafterConfig(tap_layer_ids=tuple(recipe.tap_layer_ids), target_hidden_size=model_cfg.hidden_size,
                            target_num_hidden_layers=model_cfg.num_hidden_layers, vocab_size=model_cfg.vocab_size,
                            hidden_size=recipe.hidden_size)
        seqs = target_sequences(llm, drafter_prompts(recipe.prompts, recipe.seed), recipe)
        log(f"target continuations: {len(seqs)} sequences, {sum(len(s) - n for s, n in seqs)} generated tokens "
            f"({time.perf_counter() - started:.0f} s)")
        taps = tapped_states(llm.model, [s for s, _ in seqs], cfg.tap_layer_ids)
        examples = training_examples(seqs, taps, recipe.unroll)
        log(f"{examples[0].shape[0]} training positions ({time.perf_counter() - started:.0f} s)")
        del llm
        drafter, losses = fit_drafter(cfg, *examples, recipe, log)
        root = save_drafter(drafter, directory)
        tenth = max(1, len(losses) // 10)
        report: dict[str, Any] = {
            "recipe": {**dataclasses.asdict(recipe), "tap_layer_ids": list(recipe.tap_layer_ids)},
            "parameters": sum(p.numel() for p in drafter.parameters()),
            "training_positions": int(examples[0].shape[0]),
            "loss_first_tenth": sum(losses[:tenth]) / tenth, "loss_last_tenth": sum(losses[-tenth:]) / tenth,
            "seconds": time.perf_counter() - started,
        }
        log(f"trained in {report['seconds']:.0f} s: loss {report['loss_first_tenth']:.3f} -> "
            f"{report['loss_last_tenth']:.3f}; wrote {root}")
        if measure:
            report["acceptance_k3"] = measure_acceptance(target, root)
            log(f"mean accepted tokens per step (k=3): {report['acceptance_k3']['spec_mean_accepted_length']:.3f}")
        (root / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        return report
    finally:
        torch.set_num_threads(previous_threads)
