"""ONNX Runtime target: export (HF -> ONNX with KV cache), quantize, optimize, and the engine.

Submodules are imported lazily by the stages; ``pipeline.ort.engine`` needs only numpy + onnxruntime.
"""
