"""The training loop: AdamW over the checkpoint's tensors, linear warmup then a cosine schedule, gradient
clipping, auxiliary-loss-free expert balancing, and held-out loss reports.

The trained tensors are the parameters of the serving model's modules (:mod:`rocm_k3.training.forward`: fp32,
reference ops, on the CPU for the committed checkpoint). The router's
``e_score_correction_bias`` is not a gradient parameter: after every step each MoE layer moves it by
``bias_update_rate`` towards balance (``+rate`` for experts that got fewer than the mean number of tokens,
``-rate`` for those that got more), as K3's noaux_tc routing is trained. Seeded: the same corpus, config and
thread count give the same tensors.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from rocm_k3.checks import check_int
from rocm_k3.model.config import ModelConfig
from rocm_k3.model.decoder import KimiModel
from rocm_k3.model.moe import MoEBlock
from rocm_k3.training.batches import Batch, make_batches, target_loss
from rocm_k3.training.corpus import DRILL, PROSE, Example
from rocm_k3.training.forward import checkpoint_tensors_of, decayed_parameters, training_model
from rocm_k3.training.params import init_params

Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """seed: initial weights and batch order; steps; batch_tokens: rows x longest row per step; lr: peak rate
    after a linear warmup over ``warmup_fraction`` of the steps, decaying on a cosine to lr * min_lr_ratio;
    clip: gradient norm bound; drill_steps: the first steps (of ``steps``) train on the copy drills alone
    (:mod:`rocm_k3.training.drills`)."""

    seed: int = 0
    steps: int = 1100
    drill_steps: int = 300
    batch_tokens: int = 2048
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_fraction: float = 0.03
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    bias_update_rate: float = 1e-3
    log_every: int = 50

    def __post_init__(self) -> None:
        for name in ("steps", "batch_tokens", "log_every"):
            check_int(name, getattr(self, name))
        if isinstance(self.drill_steps, bool) or not isinstance(self.drill_steps, int) or not (
                0 <= self.drill_steps <= self.steps):
            raise ValueError(f"drill_steps: expected an int in [0, steps={self.steps}], got {self.drill_steps!r}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction: expected a number in [0, 1), got {self.warmup_fraction!r}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.clip > 0 and self.weight_decay >= 0):
            raise ValueError(f"lr, min_lr_ratio, clip, weight_decay: expected lr > 0, min_lr_ratio in [0, 1], "
                             f"clip > 0, weight_decay >= 0; got {self.lr}, {self.min_lr_ratio}, {self.clip}, "
                             f"{self.weight_decay}")

    @property
    def warmup_steps(self) -> int:
        return round(self.steps * self.warmup_fraction)

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step`` (0-based)."""
        warmup = self.warmup_steps
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.steps - warmup)
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclasses.dataclass
class TrainResult:
    params: dict[str, torch.Tensor]
    losses: list[float]  # mean target NLL (nats/token) of every step
    seconds: float


def group_of(example: Example) -> str:
    return example.kind if example.kind in (PROSE, DRILL) else "chat"


def train(cfg: ModelConfig, rows: Sequence[Example], config: TrainConfig, pad_id: int,
          log: Log = print, device: str | torch.device = "cpu", drills: Sequence[Example] = ()) -> TrainResult:
    """Train the model of ``cfg`` from its seeded initialisation: ``config.drill_steps`` steps on ``drills``,
    then the rest on ``rows``.

    device: where the steps run (the initialisation is drawn on the CPU either way; the committed checkpoint is
    trained on the CPU, a GPU serves for trying recipes quickly). The result's tensors are on the CPU.
    """
    if config.drill_steps and not drills:
        raise ValueError(f"drills: drill_steps is {config.drill_steps} but no drill rows were given")
    torch.manual_seed(config.seed)
    model = training_model(cfg, init_params(cfg, config.seed), device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    decayed = decayed_parameters(model)
    plain = [p for p in trainable if not any(p is d for d in decayed)]
    opt = torch.optim.AdamW([{"params": decayed, "weight_decay": config.weight_decay},
                             {"params": plain, "weight_decay": 0.0}], lr=config.lr, betas=config.betas)
    rng = random.Random(f"batches-{config.seed}")
    pending: list[Batch] = []
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(config.steps):
        if step == config.drill_steps:
            pending = []  # the drill phase is over: switch to the corpus
        if not pending:
            source = drills if step < config.drill_steps else rows
            pending = make_batches(source, config.batch_tokens, rng, pad_id)[::-1]
        batch = pending.pop()
        for group in opt.param_groups:
            group["lr"] = config.lr_at(step)
        counts: dict[int, torch.Tensor] = {}
        loss = target_loss(model, batch.to(device), expert_counts=counts)
        mean = loss.nll / max(1, loss.count)
        opt.zero_grad(set_to_none=True)
        mean.backward()
        torch.nn.utils.clip_grad_norm_(trainable, config.clip)
        opt.step()
        _balance_experts(model, counts, config.bias_update_rate)
        losses.append(float(mean.detach()))
        if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
            recent = losses[-config.log_every:]
            log(f"step {step + 1:5d}/{config.steps}  loss {sum(recent) / len(recent):.4f} nats/token  "
                f"lr {config.lr_at(step):.2e}  {time.perf_counter() - start:7.1f} s")
    return TrainResult(checkpoint_tensors_of(model), losses, time.perf_counter() - start)


@torch.no_grad()
def _balance_experts(model: KimiModel, counts: Mapping[int, torch.Tensor], rate: float) -> None:
    for layer in model.layers:
        if isinstance(layer.ffn, MoEBlock) and layer.index in counts:
            load = counts[layer.index].float()
            layer.ffn.bias += rate * torch.sign(load.mean() - load)


@torch.no_grad()
def heldout_loss(cfg: ModelConfig, params: Mapping[str, torch.Tensor], rows: Sequence[Example],
                 batch_tokens: int, pad_id: int, device: str | torch.device = "cpu") -> dict[str, float]:
    """Mean target NLL (nats/token) of ``rows`` per group ("prose", "chat"), computed on ``device``."""
    model = training_model(cfg, params, device)
    out = {}
    for group in sorted({group_of(r) for r in rows}):
        members = [r for r in rows if group_of(r) == group]
        nll, count = 0.0, 0
        for batch in make_batches(members, batch_tokens, random.Random(0), pad_id):
            loss = target_loss(model, batch.to(device))
            nll, count = nll + float(loss.nll), count + loss.count
        out[group] = nll / max(1, count)
    return out
