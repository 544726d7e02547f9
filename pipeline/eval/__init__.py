"""Evaluation: metrics against a reference model and the FP32 torch reference."""
