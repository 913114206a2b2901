"""Stopping rules (I5), streaming text, and bad input with clear errors."""
import pytest

from exspec import EngineConfig, InvalidRequestError, LLMEngine, ModelLoadError, SamplingParams
from exspec.demo.tiny import build_tokenizer, llama

from enginekit import make_engine, make_prompts


def test_eos_stops_and_ignore_eos_runs_on(pairs):
    eos = pairs["gpt2", "eos"]
    engine = make_engine(pairs, "gpt2", "noisy", max_batch_size=16)
    prompts = make_prompts(320, eos, seed=0)
    stopped = engine.generate(prompts, SamplingParams(max_tokens=40))
    hits = [o for o in stopped if o.finish_reason == "stop"]
    assert hits, "the test pair must reach EOS on some prompt"
    for o in hits:
        assert o.token_ids[-1] == eos and eos not in o.token_ids[:-1]
    ignored = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert all(len(o.token_ids) == 40 and o.finish_reason == "length" for o in ignored)
    for s, i in zip(stopped, ignored):   # identical up to the stop point
        assert i.token_ids[:len(s.token_ids)] == s.token_ids


def test_stop_token_ids_cut_inside_an_accepted_run(pairs):
    engine = make_engine(pairs, "llama", "twin", num_speculative_tokens=8, max_batch_size=4)
    prompt = [11, 12, 13]
    full = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    stop_at = full[6]   # with a twin draft, token 6 is committed inside an 9-token accepted run
    out = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True,
                                                   stop_token_ids=[stop_at]))[0]
    first = full.index(stop_at)
    assert out.token_ids == full[:first + 1] and out.finish_reason == "stop"


def test_stop_string_truncates_text_and_tokens(pairs):
    engine = make_engine(pairs, "llama", "twin", max_batch_size=4)
    tok = engine.tokenizer
    full = engine.generate(["hello world"], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    stop = next(full.text[i:i + 3] for i in range(8, len(full.text) - 3)
                if full.text.index(full.text[i:i + 3]) == i and "\ufffd" not in full.text[i:i + 3])
    out = engine.generate(["hello world"], SamplingParams(max_tokens=40, ignore_eos=True,
                                                           stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    # tokens stop at the one that completed the stop string; nothing after it
    assert full.token_ids[:len(out.token_ids)] == out.token_ids
    assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])


def test_max_tokens_one_and_streamed_deltas_join_to_text(pairs):
    engine = make_engine(pairs, "llama", "noisy", max_batch_size=4)
    one = engine.generate(["abc"], SamplingParams(max_tokens=1))[0]
    assert len(one.token_ids) == 1 and one.finish_reason in ("length", "stop")
    engine.add_request("r1", "日本語 🚀", SamplingParams(max_tokens=48, ignore_eos=True, stop=["zz"]))
    pieces, ids = [], []
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.text_delta)
            ids += out.new_token_ids
    assert "".join(pieces) == engine.tokenizer.decode(ids, skip_special_tokens=True).split("zz")[0]


def test_detokenizer_holds_back_partial_characters_and_stop_prefixes():
    from exspec.engine.detokenizer import Detokenizer
    tok = build_tokenizer()
    text = "ab 日本語🚀 cd STOP ef"
    ids = _bytes_to_ids(tok, text.encode())   # one token per byte: characters arrive in parts
    detok = Detokenizer(tok, stop=["STOP"])
    pieces = []
    for n in range(1, len(ids) + 1):
        stopped = detok.update(ids[:n])
        delta = detok.take_delta(final=stopped)
        assert "\ufffd" not in delta, f"partial character streamed after {n} tokens"
        assert "S" not in delta, "a possible stop string was streamed"
        pieces.append(delta)
        if stopped:
            break
    assert "".join(pieces) == "ab 日本語🚀 cd "


def test_incremental_detokenizer_equals_a_full_decode_at_every_step():
    """The detokenizer decodes a short window per update, not the whole output: its text must
    still equal a full decode after every step (random ids: broken characters, merges and
    special tokens included), and a stop string must cut at its first occurrence."""
    import random
    from exspec.engine.detokenizer import Detokenizer
    tok = build_tokenizer()
    rng = random.Random(5)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True,   # noqa: E731
                                    clean_up_tokenization_spaces=False)
    for trial in range(200):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 6))]
        output = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 80))]
        stop = [decode(output[-3:])[:2]] if trial % 2 and decode(output[-3:])[:2] else []
        detok, tokens = Detokenizer(tok, stop, start=len(prompt)), list(prompt)
        while len(tokens) < len(prompt) + len(output):
            n = rng.randint(1, 6)
            tokens += output[len(tokens) - len(prompt):][:n]
            full = decode(tokens[len(prompt):])
            first = min((i for i in (full.find(s) for s in stop) if i >= 0), default=-1)
            stopped = detok.update(tokens)
            assert stopped == (first >= 0), (trial, full, stop)
            assert detok.text == (full[:first] if stopped else full), (trial, detok.text, full)
            if stopped:
                break


def _bytes_to_ids(tok, data: bytes) -> list[int]:
    """One token per byte (byte-level BPE has all 256 byte tokens)."""
    return [tok.convert_tokens_to_ids(_byte_char(b)) for b in data]


def _byte_char(b: int) -> str:
    """The GPT-2 byte-to-unicode map used by ByteLevel tokenizers."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def test_bad_requests_get_clear_errors(pairs):
    engine = make_engine(pairs, "llama", "noisy")
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("a", "", SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("b", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)
    with pytest.raises(InvalidRequestError, match="at most 16 strings"):
        SamplingParams(stop=["x"] * 17)
    with pytest.raises(InvalidRequestError, match="at most 256 characters"):
        SamplingParams(stop=["x" * 257])
    with pytest.raises(InvalidRequestError, match="at most 64 ids"):
        SamplingParams(stop_token_ids=list(range(65)))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("c", [1, 10**6], SamplingParams())
    with pytest.raises(InvalidRequestError, match="limit"):
        engine.add_request("d", [1] * 300, SamplingParams())
    engine.add_request("e", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        engine.add_request("e", [1, 2], SamplingParams())
    # only "e" was taken (the refused requests left nothing behind), and it is served
    assert engine.stats()["queue_len"] == 1
    outs = engine.generate([[3, 4]], SamplingParams(max_tokens=2))
    assert len(outs[0].token_ids) == 2 and not engine.has_unfinished()


def test_bad_engine_configs_get_clear_errors(pairs, tmp_path):
    base = dict(target_model=pairs["llama", "target"], draft_model=pairs["llama", "noisy"],
                tokenizer=pairs["tokenizer"])
    with pytest.raises(ValueError, match="unknown method"):
        EngineConfig(**base, method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(**base, num_speculative_tokens=-1)
    no_draft = {**base, "draft_model": None}
    with pytest.raises(ValueError, match="method 'exspec' needs a draft_model"):
        EngineConfig(**no_draft, method="exspec")
    assert not EngineConfig(**no_draft, method="exspec", num_speculative_tokens=0).speculative
    with pytest.raises(ValueError, match="unknown sampling_coupling 'maximal'; expected one of "
                                         "gumbel, rejection"):
        EngineConfig.from_dict({**base, "sampling_coupling": "maximal"})
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must exceed the tokens of one "
                                         r"step \(max_batch_size x \(num_speculative_tokens \+ 1\) = 48\)"):
        EngineConfig(**base, max_batch_size=8, num_speculative_tokens=5, max_num_batched_tokens=48)
    EngineConfig(**base, max_batch_size=8, num_speculative_tokens=5, max_num_batched_tokens=49)
    EngineConfig(**base, max_num_batched_tokens=None)   # chunking off
    with pytest.raises(ValueError, match="enforce_eager must be true or false"):
        EngineConfig.from_dict({**base, "enforce_eager": "false"})
    for bad in (1.0, -0.1, "0.4", "on", True):
        with pytest.raises(ValueError, match='draft_stop_confidence must be "auto" or a number in'):
            EngineConfig.from_dict({**base, "draft_stop_confidence": bad})
    # the confidence stop: adaptive k only, and only when asked for (docs/engine.md: measuring
    # the confidences cost more than the stops saved, and on a GPU it is a host read per draft)
    assert EngineConfig(**base).draft_stop == 0.0
    assert EngineConfig(**base, device="cuda").draft_stop == 0.0
    assert EngineConfig(**base, draft_stop_confidence="auto").draft_stop == "auto"
    assert EngineConfig(**base, draft_stop_confidence=0.4).draft_stop == 0.4
    assert EngineConfig(**base, device="cuda", draft_stop_confidence="auto").draft_stop == "auto"
    assert EngineConfig(**base, device="cuda", draft_stop_confidence=0.3).draft_stop == 0.3
    assert EngineConfig(**base, adaptive_k=False, draft_stop_confidence=0.3).draft_stop == 0.0
    with pytest.raises(ValueError, match="unknown engine config keys: colour"):
        EngineConfig.from_dict({**base, "colour": "blue"})
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineConfig(**{**base, "draft_model": str(tmp_path / "nope")}))
    other = llama(len(build_tokenizer()) - 7, seed=5)   # fewer rows than tokens: not padding
    other.save_pretrained(tmp_path / "narrow")
    with pytest.raises(ModelLoadError, match="vocabularies differ"):
        LLMEngine(EngineConfig(**{**base, "draft_model": str(tmp_path / "narrow")}))


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_abort_between_the_halves_of_a_tick_emits_no_more_tokens(pairs, method):
    """After abort(id) returns, the next output for id is its final one, finish_reason "abort",
    with no tokens: also when the step that would feed it was planned before the abort (the
    first half returned a new request's first token, the second half has not run yet)."""
    engine = make_engine(pairs, "llama", "noisy", method=method)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("old", [5, 6, 7], params)
    engine.add_request("kept", [8, 9], params)
    while not any(o.request_id == "old" and o.new_token_ids for o in engine.step()):
        pass
    assert engine.pool.planned is None
    engine.add_request("new", [11, 12, 13, 14], params)
    first_half = engine.step()   # plans a step for "old" and "kept", prefills "new", returns
    assert [o.request_id for o in first_half] == ["new"] and engine.pool.planned is not None
    engine.abort("old")
    nxt = {o.request_id: o for o in engine.step()}
    old = nxt.get("old")
    assert old is not None, "the aborted request got no output from the next step"
    assert old.finished and old.finish_reason == "abort", f"next output for old: {old}"
    assert old.new_token_ids == [], f"tokens emitted after abort returned: {old.new_token_ids}"
    # negative control: the planned step did run for the row that was not aborted
    assert nxt["kept"].new_token_ids and not nxt["kept"].finished
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id != "old", "output for old after its final one"


@pytest.mark.parametrize("method", ["eqspec", "exspec"])
def test_a_rows_own_speculation_cap_is_what_its_draft_counts_show(pairs, method):
    """A request capped at num_speculative_tokens 2 in a group stepped at k = 5 can keep 2 drafts
    a step: its num_draft_tokens counts those, so with a twin draft (every draft kept) its
    accepted count equals its drafted count, as the uncapped row's does."""
    engine = make_engine(pairs, "llama", "twin", method=method, num_speculative_tokens=5,
                         max_batch_size=2)
    prompts = make_prompts(320, pairs["llama", "eos"], seed=8, count=2)
    capped, free = engine.generate(prompts, [
        SamplingParams(max_tokens=24, ignore_eos=True, num_speculative_tokens=2),
        SamplingParams(max_tokens=24, ignore_eos=True)])
    for out in (capped, free):
        assert 0 < out.num_draft_tokens == out.num_accepted_draft_tokens, out
    assert capped.num_draft_tokens < free.num_draft_tokens
    stats = engine.stats()
    assert stats["acceptance_rate"] == 1.0, stats
