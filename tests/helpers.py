def rel_err(a, b):
    """max |a - b| / max |b|: the tolerance rule of the model tests."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def load_example(name: str):
    """`examples/<name>.py` as a module, loaded once (registered in sys.modules: dataclasses resolve their
    annotations through it)."""
    import importlib.util
    import sys
    from pathlib import Path

    if name not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def free_port() -> int:
    """A free local TCP port for torchrun's rendezvous (its --master_port 0 is not one the ranks can share)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mxfp4_experts(E, D, I, g, device):
    """Random MXFP4 experts (w13_packed, w13_scale, w2_packed, w2_scale) with a spread of scales (inputs of very
    different sizes share no block by accident), on `device`."""
    import torch

    from k3_kernels.mxfp4.reference import quantize_mxfp4

    w13p, w13s = quantize_mxfp4(torch.randn(E, 2 * I, D, generator=g) * torch.logspace(-3, 1, D))
    w2p, w2s = quantize_mxfp4(torch.randn(E, D, I, generator=g) * 0.1)
    return [t.to(device) for t in (w13p, w13s, w2p, w2s)]


def moe_routing(N, E, k, g, device, hot=0.0):
    """top-k routing of N tokens over E experts (weights renormalised); `hot` is added to expert 0's scores, so its
    assignments fill several tiles."""
    import torch

    scores = torch.rand(N, E, generator=g)
    scores[:, 0] += hot
    top_w, top_idx = scores.topk(k, dim=-1)
    return top_idx.to(device), (top_w / top_w.sum(-1, keepdim=True)).to(device)
