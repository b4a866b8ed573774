"""specray: a distributed executor for speculative-decoding LLM inference."""

from specray.async_llm import AsyncLLM
from specray.config import EngineConfig, KVConfig, ParallelConfig, SamplingParams, SpecConfig, StructuredOutput
from specray.errors import ConfigError, EngineClosed, SpecrayError
from specray.executor.outputs import EngineStats, RequestDelta, RequestOutput
from specray.launch.procs import RankFailure
from specray.llm import LLM

__all__ = ["LLM", "AsyncLLM", "RequestDelta", "EngineStats", "EngineConfig", "ParallelConfig", "KVConfig", "SpecConfig",
           "SamplingParams", "StructuredOutput", "RequestOutput", "SpecrayError", "ConfigError", "EngineClosed",
           "RankFailure"]
__version__ = "0.1.0"
