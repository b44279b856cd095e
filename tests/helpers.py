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
