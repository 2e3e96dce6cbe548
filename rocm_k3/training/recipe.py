"""The embedded model's recipe: build the corpus, train the tiny K3, quantise the experts, measure, write.

:func:`train_tiny` is what ``rocm-k3 train-tiny DIR`` runs: the first ``drill_steps`` steps train on copy drills
(:mod:`rocm_k3.training.drills`; without them the model never learns to copy from its context, so its answers
ignore the question), the rest on the corpus of prose and chats. The model is the tiny K3 of
:func:`rocm_k3.model.tiny.tiny_config` (with :data:`TEXT_OVERRIDES`), so it has every layer kind of K3: KDA and
MLA layers, a dense first layer, LatentMoE with MXFP4 routed experts and shared experts, SiTU, AttnRes blocks.
Held-out losses (nats per target token) are measured three ways: the fp32 weights as trained, the same with the
routed experts replaced by their MXFP4 round trip, and the written checkpoint itself (bf16 storage and MXFP4
experts, evaluated in fp32). Then the written checkpoint is served through ``rocm_k3.LLM`` and its behaviour
measured (:mod:`rocm_k3.training.behaviour`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rocm_k3.model.config import ModelConfig
from rocm_k3.model.tiny import TINY_TEXT_CONFIG, tiny_config
from rocm_k3.tokenizers.byte import embedded_byte_tokenizer
from rocm_k3.training.behaviour import arithmetic_behaviour, prose_word_rate, repeat_behaviour, tool_call_behaviour
from rocm_k3.training.corpus import Corpus, CorpusConfig, build_corpus
from rocm_k3.training.export import REPORT_FILE, write_trained_checkpoint
from rocm_k3.training.loop import TrainConfig, heldout_loss, train
from rocm_k3.training.params import bf16_round_trip, quantised_experts

# Twice the random tiny model's widths (hidden 128, 4 KDA heads): at the same step count the held-out chat loss
# falls from 0.33 to 0.27 nats/token and the weather chats close their tool calls; ~3.8 MB stored.
TEXT_OVERRIDES: dict[str, Any] = {
    "hidden_size": 128, "q_lora_rank": 64, "intermediate_size": 256, "moe_intermediate_size": 64,
    "routed_expert_hidden_size": 64,
    "linear_attn_config": {**TINY_TEXT_CONFIG["linear_attn_config"], "num_heads": 4},
}
EVAL_BATCH_TOKENS = 8192
UNIFORM_NATS = math.log(embedded_byte_tokenizer().vocab_size)  # a uniform model over the 272 ids


@dataclasses.dataclass(frozen=True)
class TinyRecipe:
    corpus: CorpusConfig = CorpusConfig()
    train: TrainConfig = TrainConfig()
    threads: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads: expected a positive int, got {self.threads!r}")


def trained_config() -> dict[str, Any]:
    """The ``config.json`` of the trained embedded model."""
    return tiny_config(TEXT_OVERRIDES)


def train_tiny(directory: str | Path, recipe: TinyRecipe = TinyRecipe(), log: Callable[[str], None] = print,
               corpus: Corpus | None = None, measure: bool = True,
               device: str | torch.device = "cpu") -> dict[str, Any]:
    """Train, write the checkpoint to ``directory`` and return the report (also in its ``training.json``).

    corpus: a prebuilt corpus (tests); default: built from ``recipe.corpus``. measure: also serve the written
    checkpoint and add its behaviour to the report. device: where training and the held-out losses run (the
    committed checkpoint: the CPU; the behaviour is always measured on the CPU reference).
    """
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        tokenizer = embedded_byte_tokenizer()
        corpus = corpus or build_corpus(recipe.corpus, tokenizer)
        summary = corpus.summary()
        log(f"corpus: {summary}")
        config = trained_config()
        cfg = ModelConfig.from_hf_dict(config)
        result = train(cfg, corpus.train, recipe.train, tokenizer.pad_token_id, log, device=device,
                       drills=corpus.drills)
        pad = tokenizer.pad_token_id
        heldout = {
            "fp32": heldout_loss(cfg, result.params, corpus.heldout, EVAL_BATCH_TOKENS, pad, device),
            "fp32_mxfp4_experts": heldout_loss(cfg, quantised_experts(result.params), corpus.heldout,
                                               EVAL_BATCH_TOKENS, pad, device),
            "checkpoint": heldout_loss(cfg, quantised_experts(bf16_round_trip(result.params)), corpus.heldout,
                                       EVAL_BATCH_TOKENS, pad, device),
        }
        tail = result.losses[-max(1, len(result.losses) // 10):]
        report = {
            "recipe": {"corpus": dataclasses.asdict(recipe.corpus), "train": dataclasses.asdict(recipe.train),
                       "threads": recipe.threads, "text_overrides": TEXT_OVERRIDES},
            "parameters": sum(t.numel() for t in result.params.values()),
            "corpus": summary,
            "train_loss_last_tenth": sum(tail) / len(tail),
            "heldout_nats_per_token": heldout,
            "heldout_prose_bits_per_byte": {k: v["prose"] / math.log(2) for k, v in heldout.items()},
            "uniform_nats_per_token": UNIFORM_NATS,
        }
        root = write_trained_checkpoint(directory, config, result.params, tokenizer, report)
        log(f"trained in {result.seconds:.0f} s; held-out nats/token {heldout} (uniform {UNIFORM_NATS:.3f}); "
            f"wrote {root}")
        if measure:
            report["behaviour"] = measure_behaviour(root, corpus.words)
            (root / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        return report
    finally:
        torch.set_num_threads(previous_threads)



def measure_behaviour(directory: str | Path, words: frozenset[str]) -> dict[str, Any]:
    """Serve the checkpoint in ``directory`` (fp32, reference ops) and measure what it does (see
    :mod:`rocm_k3.training.behaviour`); ``words``: the dictionary for the prose word rate."""
    from rocm_k3.engine.llm import LLM

    llm = LLM(directory, dtype="float32", backend="reference")
    prose = prose_word_rate(llm, words)
    arithmetic = arithmetic_behaviour(llm)
    tools = tool_call_behaviour(llm)
    repeat = repeat_behaviour(llm)
    return {
        "prose_word_rate": prose.rate, "prose_words": prose.words, "prose_samples": list(prose.samples),
        "arithmetic_stop_rate": arithmetic.stop_rate, "arithmetic_accuracy": arithmetic.accuracy,
        "arithmetic_samples": list(arithmetic.samples[:3]),
        "tool_call_rate": tools.rate, "tool_call_right_city_rate": tools.right_city_rate,
        "tool_call_samples": list(tools.samples[:3]),
        "repeat_rate": repeat.rate, "repeat_samples": list(repeat.samples[:3]),
    }
