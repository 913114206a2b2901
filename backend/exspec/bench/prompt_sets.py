"""exspec-bench's prompts: the sets shipped with it, SpecBench JSONL files, and each prompt as
the token ids a run feeds every method (through the chat template for a shipped set, earlier
turns answered by the target)."""
from __future__ import annotations

import warnings
from pathlib import Path

from tqdm.auto import tqdm

from .flags import read_jsonl
from .methods import HFModels, Prompt

# prompt sets shipped with the benchmark (our own text): "grounded" outputs repeat their input
# (edits, answers from a passage, repeat-with-changes), "open" ones do not; "agentic" repeats
# earlier requests' formats, "multiturn" (two turns) the first turn's answer, "code_edit" the code,
# "repeated" earlier requests' answers (the same asks in other words)
PROMPT_SETS = Path(__file__).resolve().parent / "prompts"
PROMPT_SET_NAMES = ("open", "agentic", "grounded", "multiturn", "code_edit", "repeated")
FALLBACK_PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n\n", "for i in range(10):\n",
                    "class Engine:\n    def __init__(self):\n", "The quick brown fox "]


def read_prompts(path: Path | None, limit: int) -> list[Prompt]:
    """SpecBench JSONL ({"question_id", "category", "turns": [...]}): the first turn of each is
    its text (a chat of every turn where the tokenizer has a template: `usable_prompts`)."""
    if path is None:
        return [Prompt(i, "builtin", t) for i, t in enumerate(FALLBACK_PROMPTS)][:limit]
    prompts = []
    for n, row in read_jsonl(path):
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{path}:{n}: \"turns\" must be a non-empty list of texts")
        prompts.append(Prompt(row.get("question_id", n - 1), row.get("category", ""), row["turns"][0],
                              turns=list(row["turns"])))
    return prompts[:limit]


def usable_prompts(args, hf: HFModels) -> list[Prompt]:
    """The prompts as token ids, without those that leave no room for max_tokens and k."""
    prompts = read_prompts(args.prompts, args.num_prompts)
    if args.prompt_set and hf.tokenizer.chat_template:
        earlier = [p for p in prompts if len(p.turns) > 1]
        for p in tqdm(earlier, desc="earlier turns (target greedy)", unit="chat",
                      disable=args.no_progress or not earlier):
            p.text = chat_of_turns(hf, p.turns, args.max_tokens)
        for p in prompts:
            if len(p.turns) <= 1:
                p.text = hf.tokenizer.apply_chat_template([{"role": "user", "content": p.text}],
                                                          add_generation_prompt=True, tokenize=False)
    room = hf.max_model_len - args.max_tokens - args.k - 1
    for p in prompts:
        p.ids = hf.tokenizer.encode(p.text, add_special_tokens=False)
    kept = [p for p in prompts if 0 < len(p.ids) <= room]
    if len(kept) < len(prompts):
        warnings.warn(f"skipped {len(prompts) - len(kept)} prompts longer than {room} tokens "
                      f"(or empty)", stacklevel=2)
    if not kept:
        raise SystemExit("exspec-bench: no usable prompts")
    return kept


def chat_of_turns(hf: HFModels, turns: list[str], max_tokens: int) -> str:
    """A multi-turn chat ending in its last user turn, each earlier turn answered by the
    target's own greedy output (what a client that keeps the conversation sends: later turns
    that ask for an answer again with a change repeat that output)."""
    messages = []
    for turn in turns[:-1]:
        messages.append({"role": "user", "content": turn})
        text = hf.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        answer = hf.generate([hf.tokenizer.encode(text, add_special_tokens=False)], max_tokens)[0]
        messages.append({"role": "assistant",
                         "content": hf.tokenizer.decode(answer, skip_special_tokens=True).strip()})
    messages.append({"role": "user", "content": turns[-1]})
    return hf.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
