from zerospeed.ops.lamb.fused_lamb import FusedLamb

__all__ = ["FusedLamb"]
