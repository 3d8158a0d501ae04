"""blockspec: lossless speculative decoding with block-diffusion (DFlash) drafters."""

from blockspec.llm import LLM
from blockspec.outputs import CompletionOutput, RequestOutput
from blockspec.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
