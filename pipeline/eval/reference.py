"""FP32 PyTorch reference model: the yardstick every engine is validated against; with ``simulate`` the same model
with its weights put on a quantizer's grid (``validate.reference: simulated``, pipeline/eval/fake_quant.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from pipeline.errors import ForgeError
from pipeline.progress import progress_bar

__all__ = ["TorchReference"]


class TorchReference:
    """An HF causal LM loaded in FP32 on ``device`` (CPU by default; ``cuda`` for the CUDA engines), in eval mode.
    Logits come back on the CPU in fp32 either way.

    ``logits(input_ids)`` runs rows in mini-batches of ``batch_size`` (a progress bar per call);
    ``generate_greedy(prompt_ids, n)`` prefills once and then feeds one token per step through the KV cache.
    """

    def __init__(self, hf_dir: str | Path, *, batch_size: int = 4, threads: int | None = None, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        hf_dir = Path(hf_dir)
        if not (hf_dir / "config.json").exists():
            raise ForgeError(f"reference model directory {hf_dir} has no config.json; point it at an HF model dir "
                             "(the source stage's output)")
        if threads:
            torch.set_num_threads(threads)
        self.hf_dir = hf_dir
        self.batch_size = batch_size
        self.device = torch.device(device)
        if self.device.type != "cpu":
            # straight onto the GPU, a slice at a time: from_pretrained(...).to("cuda") holds the whole fp32 model in
            # host RAM first (3.2x the fp16 bytes at its peak; issue 38). A checkpoint whose tensor names are not
            # the model's own (a renamed or converted layout) keeps from_pretrained.
            from pipeline.weights import load_causal_lm
            try:
                self.model = load_causal_lm(hf_dir, dtype=torch.float32, device=str(self.device))
            except ForgeError:
                self.model = None
        if self.device.type == "cpu" or self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(self.device)
        self.model.eval()
        self.config = self.model.config
        self.simulated: dict | None = None

    def simulate(self, spec: dict) -> dict:
        """Put the weights on the grids of ``spec`` in place (fake quantization, pipeline/eval/fake_quant.py): from
        here on this is the simulated reference. Returns what was quantized; ForgeError when the count of quantized
        layers is not ``spec["expect_quantized"]`` (the engine's own record), so a simulation that does not describe
        the engine is never the yardstick."""
        from .fake_quant import simulate_model
        done = simulate_model(self.model, spec)
        n = sum(v for k, v in done.items() if k.startswith("int"))
        want = spec.get("expect_quantized")
        if want is not None and n != want:
            raise ForgeError(f"validate.reference simulated: {n} linear layers put on the grid, but the engine's "
                             f"quantizer quantized {want} MatMuls; the simulation does not describe this engine "
                             "(quantize.options.exclude patterns that match ONNX node names rather than module names?)")
        self.simulated = done
        return done

    @torch.inference_mode()
    def logits(self, input_ids: Any, attention_mask: Any | None = None, *, desc: str = "reference logits") -> torch.Tensor:
        ids = torch.as_tensor(np.asarray(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids,
                              dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        mask = None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask), dtype=torch.long)
        out = []
        with progress_bar(desc, ids.shape[0]) as advance:
            for s in range(0, ids.shape[0], self.batch_size):
                m = None if mask is None else mask[s:s + self.batch_size].to(self.device)
                out.append(self.model(input_ids=ids[s:s + self.batch_size].to(self.device), attention_mask=m,
                                      use_cache=False).logits.float().cpu())
                advance(out[-1].shape[0])
        return torch.cat(out, 0)

    @torch.inference_mode()
    def generate_greedy(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                        eos_token_id: int | None = None) -> list[int]:
        """Greedy continuation (new tokens only) using the model's KV cache."""
        from transformers import DynamicCache

        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.config)
        out: list[int] = []
        with progress_bar("reference greedy", max_new_tokens) as advance:
            step_in = ids
            for _ in range(max_new_tokens):
                res = self.model(input_ids=step_in, cache=cache, use_cache=True)
                nxt = int(res.logits[0, -1].argmax())
                out.append(nxt)
                advance(1)
                if eos_token_id is not None and nxt == eos_token_id:
                    break
                step_in = torch.tensor([[nxt]], dtype=torch.long, device=self.device)
        return out
