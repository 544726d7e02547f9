"""QAT: fine-tune a ModelOpt fake-quantized model with its quantizers active, optionally distilled from FP.

ModelOpt's QAT is plain training of the ``mtq.quantize``-d model (quantizers stay in the graph, gradients
pass straight through); the KD term is ModelOpt's ``LogitsDistillationLoss`` (Hinton KL with T^2 scaling)
against the frozen FP teacher's logits. The token embedding (tied to lm_head on SmolLM2, never quantized)
is frozen: it is the largest tensor and it is not what the quantization error is in.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from pipeline.progress import progress_bar


def lr_lambda(schedule: str, total: int, warmup: int):
    """Multiplier on the base LR per optimizer step: linear warm-up, then cosine / linear decay / constant."""
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        prog = (step - warmup) / max(1, total - warmup)
        if schedule == "linear":
            return max(0.0, 1.0 - prog)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, prog)))
    return f


def train_qat(model: nn.Module, train: torch.Tensor, qat: dict, *, teacher: nn.Module | None = None,
              device: str = "cpu") -> dict:
    """Fine-tune ``model`` in place on ``train`` ``[N, T]`` windows per the resolved ``quantize.qat`` dict.

    Returns ``{"steps", "epochs", "seconds", "loss_first", "loss_last", "epoch_loss": [...],
    "log": [{"step", "loss", "ce", "kd", "lr"}...]}``.
    """
    from modelopt.torch.distill import LogitsDistillationLoss

    epochs, bs = int(qat["epochs"]), int(qat["batch"])
    dist = qat.get("distill") or {}
    use_kd = bool(dist.get("enabled")) and teacher is not None
    a = float(dist.get("alpha", 1.0)) if use_kd else 0.0
    kd_loss = LogitsDistillationLoss(temperature=float(dist.get("temperature", 1.0)), reduction="none")

    for name, p in model.named_parameters():
        p.requires_grad_("embed_tokens" not in name and "lm_head" not in name)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=float(qat["lr"]), weight_decay=0.0)
    steps_per_epoch = math.ceil(train.shape[0] / bs)
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(qat["schedule"], total, int(qat["warmup_steps"])))
    g = torch.Generator().manual_seed(int(qat.get("seed", 0)))
    if teacher is not None:
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)

    log, epoch_loss = [], []
    t0 = time.perf_counter()
    model.train()
    step = 0
    with progress_bar(f"QAT ({'distill' if use_kd else 'LM loss'})", total) as advance:
        for ep in range(epochs):
            order = torch.randperm(train.shape[0], generator=g)
            ep_sum = 0.0
            for i in range(0, train.shape[0], bs):
                x = train[order[i:i + bs]].to(device)
                out = model(input_ids=x, labels=x, use_cache=False)
                ce = out.loss
                kd = torch.zeros((), device=ce.device)
                if use_kd:
                    with torch.no_grad():
                        t_logits = teacher(input_ids=x, use_cache=False).logits
                    kd = kd_loss(out.logits[:, :-1].float(), t_logits[:, :-1].float()).mean()
                loss = a * kd + (1.0 - a) * ce
                lr_now = opt.param_groups[0]["lr"]
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                rec = {"step": step, "epoch": ep, "loss": float(loss), "ce": float(ce), "kd": float(kd),
                       "lr": lr_now}
                log.append(rec)
                ep_sum += float(loss)
                step += 1
                advance(1)
            epoch_loss.append(ep_sum / steps_per_epoch)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return {"steps": total, "epochs": epochs, "seconds": time.perf_counter() - t0,
            "loss_first": log[0]["loss"] if log else None, "loss_last": log[-1]["loss"] if log else None,
            "epoch_loss": epoch_loss, "distill": use_kd, "log": log}
