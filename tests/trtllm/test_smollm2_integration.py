"""SmolLM2-135M (FORGE_TEST_MODEL): int8_sq checkpoints at tp 1 and tp 3, contract + reference numerics (minutes)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from pipeline.eval.metrics import compare_logits
from pipeline.modelinfo import ModelInfo
from pipeline.trtllm.checkpoint import write_checkpoint
from pipeline.trtllm.contract import check_contract
from pipeline.trtllm.reference import ReferenceModel

MODEL = Path(os.environ.get("FORGE_TEST_MODEL", "/nonexistent-set-FORGE_TEST_MODEL"))
CALIB_TEXT = Path("/usr/share/common-licenses/GPL-3")      # real English text present on Debian images
EVAL_TEXT = Path("/usr/share/common-licenses/Apache-2.0")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not (MODEL / "config.json").exists(), reason=f"FORGE_TEST_MODEL {MODEL} not present"),
    pytest.mark.skipif(not CALIB_TEXT.exists() or not EVAL_TEXT.exists(), reason="license texts for calibration missing"),
]


def windows(tok, path, n, t):
    ids = tok(path.read_text(), return_tensors="pt").input_ids[0]
    assert ids.numel() >= n * t
    return ids[: n * t].reshape(n, t)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    import modelopt.torch.quantization as mtq
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(MODEL)
    fp32 = AutoModelForCausalLM.from_pretrained(MODEL, torch_dtype=torch.float32).eval()
    calib, ev = windows(tok, CALIB_TEXT, 8, 128), windows(tok, EVAL_TEXT, 2, 256)
    with torch.no_grad():
        ref32 = fp32(ev).logits
    q = copy.deepcopy(fp32)
    mtq.quantize(q, mtq.INT8_SMOOTHQUANT_CFG, lambda m: [m(calib[i:i + 2]) for i in range(0, 8, 2)])
    with torch.no_grad():
        sim = q(ev).logits
    return {"fp32": fp32, "q": q, "ev": ev, "ref32": ref32, "sim": sim, "info": ModelInfo.from_dir(MODEL),
            "root": tmp_path_factory.mktemp("smol")}


@pytest.mark.parametrize("tp", [1, 3])
def test_int8_sq_checkpoint(smol, tp):
    out = smol["root"] / f"sq_tp{tp}"
    met = write_checkpoint(smol["q"], smol["info"], MODEL, out, tp=tp, quant={"algo": "int8_sq"})
    print(f"\nSmolLM2 int8_sq tp{tp} export: {met}")
    assert check_contract(out, hf_config=__import__("json").loads((MODEL / "config.json").read_text())) == []
    assert met["export_rss_increase_bytes"] < 3 * met["model_fp16_bytes"], met
    ev = smol["ev"]
    ref = ReferenceModel(out).logits(ev)
    sim_r = compare_logits(smol["ref32"], smol["sim"], ev)
    ck_r = compare_logits(smol["ref32"], ref, ev)
    print(f"simulated (ModelOpt fake-quant): {sim_r}\ncheckpoint, reference numerics: {ck_r}")
    assert abs(ck_r["ppl"] - sim_r["ppl"]) < 1.0, (sim_r, ck_r)


def test_fp16_tp3_checkpoint(smol):
    out = smol["root"] / "fp16_tp3"
    met = write_checkpoint(smol["fp32"], smol["info"], MODEL, out, tp=3, quant={"algo": "none"})
    assert check_contract(out) == []
    r = compare_logits(smol["ref32"], ReferenceModel(out).logits(smol["ev"]), smol["ev"])
    print(f"\nSmolLM2 fp16 tp3: export {met}\ncheckpoint, reference numerics vs FP32: {r}")
    assert r["top1_agreement"] >= 0.99, r
