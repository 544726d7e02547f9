"""GPU-only: run a built TensorRT-LLM engine with TensorRT-LLM's runtime and compare it to FP32.

Uses ``tensorrt_llm.runtime.ModelRunnerCpp`` (TensorRT-LLM 1.2.x). Context logits need an engine built with
``--gather_context_logits`` (recipe key ``build.tensorrt_llm.gather_context_logits: true``). A multi-rank engine
(tp*pp > 1) runs under ``mpirun -n <world_size>`` with this module as the program; rank 0 writes the result.
Results are labelled "engine (TensorRT-LLM runtime)" — only code here ever produces that label.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import CannotRunHere

LABEL = "engine (TensorRT-LLM runtime)"


def _require():
    import importlib.util
    if importlib.util.find_spec("tensorrt_llm") is None or not torch.cuda.is_available():
        raise CannotRunHere("tensorrt_llm and an NVIDIA GPU",
                            "forge validate <recipe> on a GPU machine with tensorrt-llm 1.2.x installed")


def _world_size(engine_dir: Path) -> int:
    cfg = json.loads((engine_dir / "config.json").read_text())
    return int(cfg["pretrained_config"]["mapping"].get("world_size", 1))


def _run_local(engine_dir: str, input_ids: torch.Tensor, max_new_tokens: int) -> dict:
    import tensorrt_llm
    from tensorrt_llm.runtime import ModelRunnerCpp

    ids = [row.to(torch.int32) for row in torch.as_tensor(input_ids)]
    runner = ModelRunnerCpp.from_dir(engine_dir=engine_dir, rank=tensorrt_llm.mpi_rank(),
                                     max_batch_size=len(ids), max_input_len=max(len(r) for r in ids),
                                     max_output_len=max_new_tokens, gather_generation_logits=False)
    out = runner.generate(batch_input_ids=ids, max_new_tokens=max_new_tokens, end_id=-1, pad_id=0,
                          temperature=1.0, top_k=1, output_sequence_lengths=True, return_dict=True)
    torch.cuda.synchronize()
    res = {"output_ids": out["output_ids"].cpu()}
    if "context_logits" in out and out["context_logits"] is not None:
        cl = out["context_logits"]
        res["context_logits"] = torch.stack([c.float().cpu() for c in cl]) if isinstance(cl, list) else cl.float().cpu()
    return res


def engine_outputs(engine_dir: str | Path, input_ids: Any, *, max_new_tokens: int = 1) -> dict:
    """Context logits ``[B, T, V]`` (if the engine gathers them) and greedy ``output_ids`` from the engine."""
    _require()
    engine_dir = Path(engine_dir)
    ws = _world_size(engine_dir)
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ws == 1:
        return _run_local(str(engine_dir), ids, max_new_tokens)
    if shutil.which("mpirun") is None:
        raise CannotRunHere(f"mpirun (a {ws}-rank engine needs one process per rank)", f"mpirun -n {ws} python -m pipeline.trtllm.runtime ...")
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = Path(tmp) / "ids.pt", Path(tmp) / "out.pt"
        torch.save({"ids": ids, "max_new_tokens": max_new_tokens}, inp)
        subprocess.run(["mpirun", "--allow-run-as-root", "-n", str(ws), sys.executable, "-m", "pipeline.trtllm.runtime",
                        str(engine_dir), str(inp), str(outp)], check=True)
        return torch.load(outp)


def validate_engine(engine_dir: str | Path, fp32_logits: torch.Tensor, input_ids: Any) -> dict:
    """Compare the engine's context logits with FP32 logits (pipeline.eval.metrics), labelled as an engine run."""
    from ..eval.metrics import compare_logits
    res = engine_outputs(engine_dir, input_ids)
    if "context_logits" not in res:
        raise CannotRunHere("context logits from the engine", "rebuild with build.tensorrt_llm.gather_context_logits: true")
    metrics = compare_logits(fp32_logits, res["context_logits"][..., :fp32_logits.shape[-1]], input_ids)
    return {"label": LABEL, **metrics}


if __name__ == "__main__":  # mpirun entry: python -m pipeline.trtllm.runtime ENGINE_DIR IN.pt OUT.pt
    import tensorrt_llm
    eng, inp, outp = sys.argv[1:4]
    d = torch.load(inp)
    r = _run_local(eng, d["ids"], d["max_new_tokens"])
    if tensorrt_llm.mpi_rank() == 0:
        torch.save(r, outp)
