"""Triton model repositories (onnxruntime and tensorrt_llm targets), manifest / verify-deploy, and serving.

- ``repo_onnxruntime.write_onnxruntime_repo`` / ``repo_trtllm.write_trtllm_repo``: write a repository
- ``repo_trtllm.check_triton_vs_engine``: plan-time problems naming ``package.triton.<key>``
- ``pbtxt.parse_all_configs``: every config.pbtxt parsed into Triton's ModelConfig protobuf
- ``manifest.write_manifest`` / ``verify_deploy`` / ``current_env``
- ``serve.TritonServer`` / ``serve.serve`` / ``find_tritonserver``: the nvidia-pytriton tritonserver
"""
