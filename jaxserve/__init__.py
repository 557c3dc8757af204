"""jaxserve: a JAX/XLA inference server for large language models on TPU and GPU."""

from importlib.metadata import PackageNotFoundError, version

from jaxserve.beam_search import BeamSearchParams
from jaxserve.outputs import (ClassificationOutput, ClassificationRequestOutput,
                              CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
                              RequestOutput, ScoringOutput, ScoringRequestOutput)
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

try:
    __version__ = version("jaxserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name):
    # LLM pulls in JAX and Flax; import it lazily so `jaxserve --help` stays quick.
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    if name == "LoRARequest":
        from jaxserve.engine.lora import LoRARequest

        return LoRARequest
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "SamplingParams", "BeamSearchParams", "PoolingParams",
           "RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "EmbeddingOutput",
           "ClassificationRequestOutput", "ClassificationOutput", "ScoringRequestOutput",
           "ScoringOutput"]
