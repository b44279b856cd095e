"""transformers-k3: Kimi K3 for Hugging Face transformers.

Importing the package registers the K3 config and model classes with the transformers Auto classes and the
released checkpoint's weight conversions (MXFP4 routed experts). It needs no GPU and no Triton.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

from .configuration_kimi_k3 import KimiK3Config, KimiK3ConfigError, KimiK3TextConfig, KimiK3VisionConfig
from .cache_kimi_k3 import KimiK3Cache, KimiK3PrefixStore
from .modeling_kimi_k3 import (
    KimiK3ForCausalLM,
    KimiK3ForConditionalGeneration,
    KimiK3Model,
    KimiK3PreTrainedModel,
)
from .conversion import register_conversions
from .image_processing_kimi_k3 import KimiK3ImageProcessor
from .processing_kimi_k3 import KimiK3Processor
from .tokenization_kimi_k3 import KimiK3Tokenizer

AutoConfig.register(KimiK3Config.model_type, KimiK3Config)
AutoConfig.register(KimiK3TextConfig.model_type, KimiK3TextConfig)
AutoModel.register(KimiK3TextConfig, KimiK3Model)
AutoModel.register(KimiK3Config, KimiK3ForConditionalGeneration)
AutoModelForCausalLM.register(KimiK3TextConfig, KimiK3ForCausalLM)
# As the release's own auto_map: a causal LM from the released directory is the whole container.
AutoModelForCausalLM.register(KimiK3Config, KimiK3ForConditionalGeneration)
AutoModelForImageTextToText.register(KimiK3Config, KimiK3ForConditionalGeneration)
register_conversions()
# No AutoTokenizer registration, on purpose: the released tokenizer_config.json names a remote-code class, and with
# a local class registered for the config transformers stops asking for remote code and converts tiktoken.model
# with the generic GPT-4 pattern instead (silently different ids). Use KimiK3Tokenizer, or `k3 convert-tokenizer`
# once, after which AutoTokenizer loads the saved tokenizer.json with plain transformers.
# Processors: no remote code, so register them at import like the config and models.
from transformers import AutoImageProcessor, AutoProcessor  # noqa: E402

# Separate tries: transformers 5.17 without torchvision refuses the image-processor registration with an
# ImportError, which must not also skip the processor's (AutoProcessor would then return only the tokenizer).
try:
    AutoImageProcessor.register(KimiK3Config, slow_image_processor_class=KimiK3ImageProcessor, exist_ok=True)
except ImportError:
    pass
try:
    AutoProcessor.register(KimiK3Config, KimiK3Processor, exist_ok=True)
except ImportError:  # some transformers versions refuse the registration without Pillow; the text model needs none
    pass

__version__ = "0.1.0"
__all__ = [
    "KimiK3Config", "KimiK3TextConfig", "KimiK3VisionConfig", "KimiK3ConfigError", "KimiK3Cache", "KimiK3PrefixStore",
    "KimiK3Model", "KimiK3ForCausalLM", "KimiK3ForConditionalGeneration", "KimiK3PreTrainedModel",
    "KimiK3ImageProcessor", "KimiK3Processor", "KimiK3Tokenizer",
]
