"""specray: a distributed executor for speculative-decoding LLM inference."""

from specray.config import EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig
from specray.executor.engine import RequestOutput
from specray.llm import LLM

__all__ = ["LLM", "EngineConfig", "ParallelConfig", "KVConfig", "SpecConfig", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
