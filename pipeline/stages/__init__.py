"""Stage flows per build target."""

from __future__ import annotations

from .base import Stage


def flow_for(target: str) -> list[Stage]:
    from .onnxruntime import OrtBuildStage, OrtEvaluate, OrtExport, OrtPackage, OrtQuantize
    from .source import SourceStage
    from .validate import ValidateCheckpointStage, ValidateStage

    if target == "onnxruntime":
        classes = [SourceStage, OrtExport, OrtQuantize, OrtBuildStage, OrtEvaluate, ValidateStage, OrtPackage]
    elif target == "tensorrt_llm":
        from .tensorrt_llm import (CheckpointEvaluate, ModeloptQuantize, TrtllmBuildDeploy, TrtllmBuildStage,
                                   TrtllmCheckpoint, TrtllmEvaluate, TrtllmPackage)
        classes = [SourceStage, ModeloptQuantize, TrtllmCheckpoint, CheckpointEvaluate, ValidateCheckpointStage,
                   TrtllmBuildStage, TrtllmEvaluate, ValidateStage, TrtllmBuildDeploy, TrtllmPackage]
    elif target == "tensorrt":
        from .tensorrt import QdqEvaluate, QdqValidate, TensorrtBuildStage, TensorrtQuantize
        classes = [SourceStage, OrtExport, TensorrtQuantize, QdqEvaluate, QdqValidate, TensorrtBuildStage]
    else:
        raise ValueError(f"unknown build.target {target!r}")
    return [c() for c in classes]
