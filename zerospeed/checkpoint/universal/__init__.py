"""DeepSpeed's universal checkpoint: one folder of full per-parameter files, loadable at any layout.

layout.py (names), folder.py (the crash-safe folder write), source.py (the checkpoint's files by
mp rank: tp pieces, pipeline stages, MoE experts), convert.py (a ZeRO checkpoint to a universal
folder, streamed), read.py (a universal folder as the full optimizer state) and
engine_load.py (`"checkpoint": {"load_universal": true}` in `load_checkpoint`).
"""
