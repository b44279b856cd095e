import os

import torch

# Without a GPU the Triton kernels' tests run on the CPU interpreter. The switch is read when triton is first
# imported (fla and transformers may import it), so it is set here, before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import transformers_k3  # noqa: F401,E402  (registers the Auto classes)
from transformers_k3.tiny import tiny_config, write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A small fp32 checkpoint in the released layout (MXFP4 experts, padded A_log, vision slots)."""
    path = tmp_path_factory.mktemp("tiny_k3")
    write_tiny_checkpoint(path, seed=0, dtype=torch.float32)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from transformers_k3 import KimiK3ForConditionalGeneration

    model = KimiK3ForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture()
def lm(tiny_model):
    return tiny_model.language_model



def pytest_sessionstart(session):
    # In CI the external oracles must really run: a skipped oracle test would hide a wrong reference.
    import os

    if os.environ.get("CI"):
        try:
            import fla.ops.kda.naive  # noqa: F401
        except Exception as exc:  # pragma: no cover - only on a broken CI install
            raise pytest.UsageError(f"CI needs fla-core importable for the oracle tests: {exc}")
