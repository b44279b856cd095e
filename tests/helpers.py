def rel_err(a, b):
    """max |a - b| / max |b|: the tolerance rule of the model tests."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
