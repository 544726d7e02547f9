"""TensorRT-LLM target: checkpoint export + fix-ups, contract check, reference numerics, build config, build, runtime.

Everything here runs on CPU except ``build.build_engine`` (needs ``trtllm-build``) and ``runtime`` (needs
tensorrt_llm and a GPU). Results of ``reference`` are labelled "checkpoint, reference numerics", never "engine".
"""

from .build_config import trtllm_build_args, validate_build  # noqa: F401
