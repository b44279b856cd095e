import os

import torch

# Without a GPU the Triton kernels' tests run on the CPU interpreter. The switch is read when triton is first
# imported (fla and transformers may import it), so it is set here, before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import transformers_k3  # noqa: F401,E402  (registers the Auto classes)
from transformers_k3.tiny import tiny_config, write_tiny_checkpoint


def _launches_without_fp_fusion() -> list[str]:
    """Record every launch of one of our kernels (`k3_kernels`) that does not pass `enable_fp_fusion=True`.

    Each launch pins FP fusion (FMA contraction) on: the kernels' timings and tolerances were measured with it, triton
    3.9 warns at every launch that leaves it unset, and 3.10 turns the default off. The launch wrappers are patched,
    not the kernels, so the interpreter (CPU) and the compiled launches (GPU, Gluon too) are both checked; a
    violation is only recorded here, so that a dispatcher's fallback cannot swallow it, and `_fp_fusion_pinned`
    fails the test that launched it."""
    missing: list[str] = []
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # no triton: the kernels' tests skip, nothing launches
        return missing
    for cls in (JITFunction, InterpretedFunction):
        def run(self, *args, _run=cls.run, **kwargs):
            if kwargs.get("enable_fp_fusion") is not True and self.fn.__module__.startswith("k3_kernels"):
                missing.append(f"{self.fn.__module__}.{self.fn.__name__}")
            return _run(self, *args, **kwargs)

        cls.run = run
    return missing


_NO_FP_FUSION = _launches_without_fp_fusion()


@pytest.fixture(autouse=True)
def _fp_fusion_pinned():
    _NO_FP_FUSION.clear()
    yield
    if _NO_FP_FUSION:
        pytest.fail(f"kernel launches without enable_fp_fusion=True: {sorted(set(_NO_FP_FUSION))}")


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
