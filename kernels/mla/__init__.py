from .reference import mla_absorbed_attention

__all__ = ["mla_absorbed_attention"]
