"""Inference (DeepSpeed's ``deepspeed.inference``): `init_inference` builds an `InferenceEngine`.

config.py (the ``init_inference`` config), sharding.py (AutoTP with training's rules over the
tensor-parallel group), checkpoint_loading.py (each rank reads its slices), engine.py (the
engine). Guide: docs/inference.md. DeepSpeed's FastGen (inference v2: ``build_hf_engine``...) is
not part of zerospeed.
"""

from zerospeed.inference.config import DeepSpeedInferenceConfig, DeepSpeedTPConfig
from zerospeed.inference.engine import InferenceEngine

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedTPConfig", "InferenceEngine"]
