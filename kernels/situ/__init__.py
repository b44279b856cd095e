"""SiTU-GLU activation (reference)."""

from .reference import situ_glu

__all__ = ["situ_glu"]
