from .reference import mla_absorbed_attention, mla_paged_decode_reference

__all__ = ["mla_absorbed_attention", "mla_paged_decode_reference"]
