"""The tensorrt target: ModelOpt ONNX PTQ (QDQ INT8 / FP8) of forge's ONNX graph, then a TensorRT engine via Polygraphy.

``quantize.quantize_for_tensorrt`` runs anywhere (calibration on ONNX Runtime's CPU provider);
``build.build_tensorrt_engine`` needs an NVIDIA GPU with ``tensorrt`` installed.
"""
