"""Tiny, seeded model pairs built in code: for tests, for the demo before a trained pair exists,
and for anyone who wants to try the engine without downloading weights.

A pair is saved in Hugging Face format (tokenizer/, target/, draft/), so everything downstream
loads it exactly as it would load a hub model.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

EOS = "<|endoftext|>"

# A small multilingual corpus: byte-level BPE merges across words, CJK and emoji, so streamed
# text exercises partial UTF-8 and multi-token stop strings.
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "The quick brown fox jumps over the lazy dog. ",
    "Speculative decoding drafts tokens and the target verifies them. ",
    "import os\nimport sys\n\nclass Engine:\n    pass\n",
    "日本語のテキストと中文文本。 ",
    "emoji: 🚀🔥✨🎉 ",
    "Grüße, naïve café, déjà vu. ",
    "hello world, hello there, stop here STOP. ",
]


# A plain chat template for code-completion toys (the demo pair, the test pairs): system messages
# become Python comments, the other messages' contents follow one per line, and the model
# continues right after the last one, so a one-message chat is the same prompt as a completion.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first %}{{ '\\n' }}{% endif -%}"
    "{%- if message['role'] == 'system' %}{{ '# ' }}{% endif -%}"
    "{{ message['content'] }}"
    "{%- endfor -%}")


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: every byte is a token, plus a few merges and one EOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   pad_token=EOS, unk_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llama(vocab_size: int, seed: int, layers: int = 2, hidden: int = 64, heads: int = 4,
          kv_heads: int = 2, max_positions: int = 256, eos_token_id: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                         bos_token_id=eos_token_id, eos_token_id=eos_token_id,
                         pad_token_id=eos_token_id, tie_word_embeddings=False)
    return _init(LlamaForCausalLM(config))


def gpt2(vocab_size: int, seed: int, layers: int = 2, hidden: int = 64, heads: int = 4,
         max_positions: int = 128, eos_token_id: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads,
                        n_positions=max_positions, bos_token_id=eos_token_id,
                        eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    return _init(GPT2LMHeadModel(config))


def _init(model):
    # Larger-than-default weights make the logits peaked, so greedy ties never happen and
    # random models still produce varied (not constant) continuations.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.eval()


def noisy_copy(model, seed: int, scale: float = 0.05):
    """A draft that mostly agrees with `model`: its weights plus seeded Gaussian noise."""
    draft = type(model)(model.config)
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            spread = p.std() if p.numel() > 1 else p.abs()   # a scalar has no spread
            p.add_(torch.randn(p.shape, generator=gen) * scale * spread.clamp_min(1e-3))
    return draft.eval()


def save_pair(out_dir: str | Path, tokenizer, target, draft) -> Path:
    out = Path(out_dir)
    tokenizer.save_pretrained(out / "tokenizer")
    target.save_pretrained(out / "target")
    draft.save_pretrained(out / "draft")
    return out


def build_demo_pair(out_dir: str | Path, seed: int = 0) -> Path:
    """The pair `make demo` uses until a trained one ships: a Llama target and a noisy draft."""
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    target = llama(vocab, seed, layers=4, hidden=128, max_positions=512,
                   eos_token_id=tokenizer.eos_token_id)
    draft = noisy_copy(target, seed + 1, scale=0.02)
    return save_pair(out_dir, tokenizer, target, draft)
