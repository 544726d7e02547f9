"""forge's own Triton model-config templates (dicts validated against ModelConfig when written).

Shared by both targets: ``preprocessing``, ``postprocessing``, ``ensemble`` and the BLS model speak
the tensor names of TensorRT-LLM's Triton repository (trtllm-reference.md §4.3), so the only
per-target model is the engine model (``tensorrt_llm`` C++ backend, or forge's ``onnxruntime_llm``
python model with the same tensor interface).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.triton.pbtxt import params, tensor

PY_MODELS = Path(__file__).parent / "python_models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "config.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")

# client-facing inputs: name -> (dtype, optional, preprocessing input, engine input)
ENSEMBLE_INPUTS = {
    "text_input": ("TYPE_STRING", False, "QUERY", None),
    "max_tokens": ("TYPE_INT32", False, "REQUEST_OUTPUT_LEN", None),
    "end_id": ("TYPE_INT32", True, "END_ID", None),
    "pad_id": ("TYPE_INT32", True, "PAD_ID", None),
    "top_k": ("TYPE_INT32", True, None, "runtime_top_k"),
    "top_p": ("TYPE_FP32", True, None, "runtime_top_p"),
    "temperature": ("TYPE_FP32", True, None, "temperature"),
    "seed": ("TYPE_UINT64", True, None, "seed"),
}
STREAM_INPUT = {"stream": ("TYPE_BOOL", True, None, "streaming")}

# engine model tensors (subset of TensorRT-LLM's tensorrt_llm model that forge uses). Every engine input that
# ENSEMBLE_INPUTS / STREAM_INPUT name is here, so both targets' engine models declare what the ensemble and the
# BLS send (issue 28: ``streaming`` was only in the tensorrt_llm model's extras, and onnxruntime_llm refused it).
ENGINE_INPUTS = [
    ("input_ids", "TYPE_INT32", [-1], False), ("input_lengths", "TYPE_INT32", [1], False),
    ("request_output_len", "TYPE_INT32", [1], False), ("end_id", "TYPE_INT32", [1], True),
    ("pad_id", "TYPE_INT32", [1], True), ("runtime_top_k", "TYPE_INT32", [1], True),
    ("runtime_top_p", "TYPE_FP32", [1], True), ("temperature", "TYPE_FP32", [1], True),
    ("seed", "TYPE_UINT64", [1], True), ("streaming", "TYPE_BOOL", [1], True),
]
ENGINE_OUTPUTS = [("output_ids", "TYPE_INT32", [-1, -1]), ("sequence_length", "TYPE_INT32", [-1])]


def _scalar(name, dtype, optional=False):
    # TensorRT-LLM's convention: per-request scalars are dims [1] reshaped to [] for the backend
    return tensor(name, dtype, [1], optional=optional)


def preprocessing(max_batch_size: int, instance_count: int, add_special_tokens: bool = False) -> dict:
    return {
        "name": "preprocessing", "backend": "python", "max_batch_size": max_batch_size,
        "input": [tensor("QUERY", "TYPE_STRING", [1]), tensor("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1]),
                  tensor("END_ID", "TYPE_INT32", [1], optional=True), tensor("PAD_ID", "TYPE_INT32", [1], optional=True)],
        "output": [tensor("INPUT_ID", "TYPE_INT32", [-1]), tensor("REQUEST_INPUT_LEN", "TYPE_INT32", [1]),
                   tensor("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1]), tensor("OUT_END_ID", "TYPE_INT32", [1]),
                   tensor("OUT_PAD_ID", "TYPE_INT32", [1])],
        "parameters": params(tokenizer_dir="tokenizer", add_special_tokens=add_special_tokens),
        "instance_group": [{"count": instance_count, "kind": "KIND_CPU"}],
    }


def postprocessing(max_batch_size: int, instance_count: int, skip_special_tokens: bool = True) -> dict:
    return {
        "name": "postprocessing", "backend": "python", "max_batch_size": max_batch_size,
        "input": [tensor("TOKENS_BATCH", "TYPE_INT32", [-1, -1]), tensor("SEQUENCE_LENGTH", "TYPE_INT32", [-1])],
        "output": [tensor("OUTPUT", "TYPE_STRING", [-1]), tensor("OUTPUT_IDS", "TYPE_INT32", [-1, -1])],
        "parameters": params(tokenizer_dir="tokenizer", skip_special_tokens=skip_special_tokens),
        "instance_group": [{"count": instance_count, "kind": "KIND_CPU"}],
    }


def ensemble(max_batch_size: int, engine_model: str, *, streaming: bool = False) -> dict:
    inputs = dict(ENSEMBLE_INPUTS, **(STREAM_INPUT if streaming else {}))
    pre_fwd, eng_fwd = forwards(inputs)
    pre_map = {pre: name for name, pre in pre_fwd.items()}
    eng_map = {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
               "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_END_ID", "pad_id": "_PAD_ID"}
    eng_map.update({eng: name for name, eng in eng_fwd.items()})
    return {
        "name": "ensemble", "platform": "ensemble", "max_batch_size": max_batch_size,
        "input": [tensor(n, dt, [1], optional=opt) for n, (dt, opt, _, _) in inputs.items()],
        "output": [tensor("text_output", "TYPE_STRING", [-1]), tensor("output_ids", "TYPE_INT32", [-1, -1])],
        "ensemble_scheduling": {"step": [
            {"model_name": "preprocessing", "model_version": -1, "input_map": pre_map,
             "output_map": {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
                            "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "OUT_END_ID": "_END_ID", "OUT_PAD_ID": "_PAD_ID"}},
            {"model_name": engine_model, "model_version": -1, "input_map": eng_map,
             "output_map": {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"}},
            {"model_name": "postprocessing", "model_version": -1,
             "input_map": {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
             "output_map": {"OUTPUT": "text_output", "OUTPUT_IDS": "output_ids"}},
        ]},
    }


def forwards(inputs: dict) -> tuple[dict, dict]:
    """Client input -> preprocessing input, and client input -> engine input, forwarded as sent: the ensemble's
    step input maps and the BLS's. The BLS config carries them (parameters ``preprocessing_inputs`` /
    ``engine_inputs``) and python_models/bls.py reads them there, so the BLS sends what these tables say and
    :func:`pipeline.triton.pbtxt.parse_all_configs` checks that the receiving models declare it."""
    return ({n: pre for n, (_, _, pre, _) in inputs.items() if pre},
            {n: eng for n, (_, _, _, eng) in inputs.items() if eng})


def bls(name: str, max_batch_size: int, engine_model: str, *, decoupled: bool, instance_count: int) -> dict:
    inputs = dict(ENSEMBLE_INPUTS, **STREAM_INPUT)
    pre_map, eng_map = forwards(inputs)
    return {
        "name": name, "backend": "python", "max_batch_size": max_batch_size,
        "model_transaction_policy": {"decoupled": decoupled},
        "input": [tensor(n, dt, [1], optional=opt) for n, (dt, opt, _, _) in inputs.items()],
        "output": [tensor("text_output", "TYPE_STRING", [-1]), tensor("output_ids", "TYPE_INT32", [-1, -1])],
        "parameters": params(tensorrt_llm_model_name=engine_model, preprocessing_model_name="preprocessing",
                             postprocessing_model_name="postprocessing",
                             preprocessing_inputs=json.dumps(pre_map, sort_keys=True),
                             engine_inputs=json.dumps(eng_map, sort_keys=True)),
        "instance_group": [{"count": instance_count, "kind": "KIND_CPU"}],
    }


def copy_python_model(source: str, model_dir: Path, extra: dict[str, Path] | None = None) -> None:
    """Copy ``python_models/<source>.py`` to ``<model_dir>/1/model.py`` (+ extra files into 1/)."""
    vdir = model_dir / "1"
    vdir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(PY_MODELS / f"{source}.py", vdir / "model.py")
    for dst, src in (extra or {}).items():
        shutil.copy2(src, vdir / dst)


def copy_tokenizer(tokenizer_dir: Path, dst: Path) -> list[str]:
    from pipeline.errors import ForgeError

    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").exists():
        raise ForgeError(f"{tokenizer_dir}: no tokenizer.json; the Triton pre/postprocessing models need a fast "
                         "(tokenizers) tokenizer; save one with AutoTokenizer.from_pretrained(...).save_pretrained(dir)")
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy2(tokenizer_dir / f, dst / f)
            copied.append(f)
    return copied


def write_common(out: Path, tokenizer_dir: Path, max_batch_size: int, instance_count: int, *,
                 add_special_tokens: bool = False) -> None:
    from pipeline.triton.pbtxt import write_config

    for name, cfg in (("preprocessing", preprocessing(max_batch_size, instance_count, add_special_tokens)),
                      ("postprocessing", postprocessing(max_batch_size, instance_count))):
        write_config(out / name, cfg)
        copy_python_model(name, out / name)
        copy_tokenizer(tokenizer_dir, out / name / "1" / "tokenizer")
