"""IncrementalDetokenizer and StopStringMatcher, against the default model's real tokenizer.

Expected text is always ``tokenizer.decode`` of the whole sequence, or written by hand.
"""

from __future__ import annotations

import pytest

from pdserve.server.detokenizer import (
    NUM_PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    StopStringMatcher,
)

IM_START_ID = 1
IM_END_ID = 2

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog, doesn't it?",
    "code": "def add(a, b):\n    if a:\n        return a + b\n\treturn b\n\n\nprint(add(1, 2))\n",
    "cjk": "你好，世界 🌍",
    "emoji": "👨\u200d👩\u200d👧 🇫🇷 ok",
    "accents": "déjà vu",
}


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.engine.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def chat_prompt_ids(tokenizer):
    """A real chat prompt ending in ``<|im_start|>assistant\\n``."""
    text = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Feed ``ids`` one at a time; the deltas, the final flush last."""
    return [detok.add_tokens([i]) for i in ids] + [detok.flush()]


def stream_stop(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    """Feed ``deltas`` until stopped; the text sent (flushed if not stopped) and stopped."""
    sent = []
    for delta in deltas:
        safe, stopped = matcher.process(delta)
        sent.append(safe)
        if stopped:
            return "".join(sent), True
    return "".join(sent) + matcher.flush(), False


# --- IncrementalDetokenizer ------------------------------------------------------------


def test_precondition_test_texts_split_characters_over_several_tokens(tokenizer):
    # Decoding these texts' tokens one by one does break characters.
    for name in ("cjk", "emoji"):
        pieces = [tokenizer.decode([i]) for i in encode(tokenizer, TEXTS[name])]
        assert any("\ufffd" in p for p in pieces), name


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_one_token_at_a_time_never_emits_replacement_char(tokenizer, name):
    ids = encode(tokenizer, TEXTS[name])
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_token_ids=[]), ids)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_joined_deltas_equal_full_decode(tokenizer, name):
    ids = encode(tokenizer, TEXTS[name])
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_token_ids=[]), ids)
    assert "".join(deltas) == tokenizer.decode(ids)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_joined_deltas_after_chat_prompt_equal_full_decode(tokenizer, chat_prompt_ids, name):
    ids = encode(tokenizer, TEXTS[name])
    deltas = stream(IncrementalDetokenizer(tokenizer, chat_prompt_ids), ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_first_token_leading_space_is_kept(tokenizer, chat_prompt_ids):
    ids = encode(tokenizer, " Hello world")
    assert tokenizer.decode(ids[:1]) == " Hello"
    detok = IncrementalDetokenizer(tokenizer, chat_prompt_ids)
    assert detok.add_tokens(ids[:1]) == " Hello"


class SentencePieceLikeDecoder:
    """A hand-made SentencePiece-style decoder: "▁" is a space; a leading space is dropped."""

    PIECES = {0: "▁Hello", 1: "▁world", 2: "!"}

    def decode(self, token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return "".join(self.PIECES[i] for i in token_ids).replace("▁", " ").removeprefix(" ")


def test_sentencepiece_first_token_keeps_its_space_after_a_prompt():
    detok = IncrementalDetokenizer(SentencePieceLikeDecoder(), prompt_token_ids=[0])
    assert [detok.add_tokens([1]), detok.add_tokens([2])] == [" world", "!"]


def test_sentencepiece_without_prompt_matches_decode_of_generated_ids():
    detok = IncrementalDetokenizer(SentencePieceLikeDecoder(), prompt_token_ids=[])
    assert detok.add_tokens([0]) + detok.add_tokens([1]) == "Hello world"


def test_long_prompt_gives_same_text_as_no_prompt(tokenizer):
    prompt = encode(tokenizer, "A long prompt " * 10 + "ending in an emoji 🌍")
    assert len(prompt) > NUM_PROMPT_CONTEXT_TOKENS
    ids = encode(tokenizer, " and then some text: 你好")
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_prompt_ending_mid_character_is_not_used_as_context(tokenizer):
    emoji_ids = encode(tokenizer, "🌍")  # several byte-level tokens
    assert len(emoji_ids) > 1
    prompt = encode(tokenizer, "Hi ") + emoji_ids[:1]
    ids = emoji_ids[1:] + encode(tokenizer, " ok 👍")  # starts with the character's tail bytes
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_multibyte_character_is_released_when_its_last_token_arrives(tokenizer):
    ids = encode(tokenizer, "🌍")
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    assert [detok.add_tokens([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.has_pending
    assert detok.add_tokens(ids[-1:]) == "🌍"
    assert not detok.has_pending


def test_many_tokens_at_once_equal_one_at_a_time(tokenizer):
    ids = encode(tokenizer, TEXTS["emoji"] + " " + TEXTS["cjk"])
    one_at_a_time = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    expected = [one_at_a_time.add_tokens(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    batched = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    got = [batched.add_tokens(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert got == expected
    assert batched.text == tokenizer.decode(ids)


def test_flush_releases_incomplete_character(tokenizer):
    ids = encode(tokenizer, "ok 🌍")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    streamed = "".join(detok.add_tokens([i]) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tokenizer.decode(ids)
    assert detok.text.endswith("\ufffd")


def test_invalid_bytes_followed_by_text_are_emitted_before_flush(tokenizer):
    emoji_ids = encode(tokenizer, "🌍")
    ids = emoji_ids[:1] + encode(tokenizer, " and more")  # a character cut short mid-stream
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    streamed = "".join(detok.add_tokens([i]) for i in ids)
    assert streamed == tokenizer.decode(ids)
    assert detok.flush() == ""


def test_text_is_all_deltas_so_far(tokenizer):
    ids = encode(tokenizer, TEXTS["english"])
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    deltas = []
    for i in ids:
        deltas.append(detok.add_tokens([i]))
        assert detok.text == "".join(deltas)
    assert detok.num_generated_tokens == len(ids)


def test_special_tokens_skipped_by_default(tokenizer, chat_prompt_ids):
    ids = encode(tokenizer, "Hello!") + [IM_END_ID]
    deltas = stream(IncrementalDetokenizer(tokenizer, chat_prompt_ids), ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == "Hello!"


def test_special_tokens_kept_without_skip(tokenizer, chat_prompt_ids):
    ids = encode(tokenizer, "Hello!") + [IM_END_ID]
    detok = IncrementalDetokenizer(tokenizer, chat_prompt_ids, skip_special_tokens=False)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=False)
    assert deltas[-2] == "<|im_end|>"


def test_skipped_special_token_between_words_keeps_spacing(tokenizer):
    ids = encode(tokenizer, "one") + [IM_START_ID] + encode(tokenizer, " two")
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_token_ids=[]), ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == "one two"


def test_logprob_bytes_of_tokens_that_split_a_character_join_to_the_text(tokenizer):
    """Chat logprobs' ``bytes``: a token holding part of an emoji decodes to U+FFFD alone,
    but its bytes are its own, so a client joining them gets the text back."""
    from pdserve.server.serving_chat import token_bytes

    text = "I love 🇫🇷 and 🐶"
    ids = encode(tokenizer, text)
    pieces = [token_bytes(tokenizer, i, tokenizer.decode([i])) for i in ids]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some split a character
    assert bytes(b for piece in pieces for b in piece) == text.encode()


def test_text_offsets_of_tokens_that_split_a_character_index_the_text(tokenizer):
    """Completions' ``text_offset``: each token's start in the decoded text, a character's
    pieces all at the character (U+FFFD, one character each, once shifted the rest)."""
    from pdserve.server.serving_completion import token_offsets

    text = "I love 🇫🇷 and 🐶 too"
    ids = encode(tokenizer, text)
    offsets = token_offsets(tokenizer, ids, 0, False)
    assert tokenizer.decode(ids) == text
    and_index = [tokenizer.decode([i]) for i in ids].index(" and")
    assert offsets[and_index] == text.index(" and")
    assert offsets == sorted(offsets) and offsets[-1] == text.index(" too")


# --- StopStringMatcher -----------------------------------------------------------------


def test_no_stop_strings_pass_text_through():
    matcher = StopStringMatcher([])
    assert matcher.process("Hello") == ("Hello", False)
    assert matcher.process(" wor") == (" wor", False)
    assert matcher.flush() == ""


def test_stop_inside_one_delta():
    assert stream_stop(StopStringMatcher(["STOP"]), ["Hello STOP world"]) == ("Hello ", True)


def test_stop_spanning_two_deltas():
    assert stream_stop(StopStringMatcher(["STOP"]), ["Hello ST", "OP world"]) == ("Hello ", True)


def test_stop_spanning_three_deltas():
    deltas = ["Hello S", "TO", "P world"]
    assert stream_stop(StopStringMatcher(["STOP"]), deltas) == ("Hello ", True)


def test_include_stop_sends_the_stop_string_too():
    assert stream_stop(StopStringMatcher(["STOP"], include_stop=True),
                       ["Hello ST", "OP world"]) == ("Hello STOP", True)


def test_no_stop_string_ends_the_text_before_min_tokens():
    """vLLM's rule: stop strings count once min_tokens tokens are out; one that ended in
    the text before that never ends it later, one that ends after it does."""
    matcher = StopStringMatcher([",", "ab"], min_tokens=3)
    assert matcher.process(" 4,", num_tokens=2) == (" 4", False)  # "," held, not a stop
    assert matcher.process(" 5", num_tokens=3) == (", 5", False)
    assert matcher.process(",", num_tokens=4) == ("", True)
    matcher = StopStringMatcher(["xaby", "ab"], min_tokens=2)
    assert matcher.process("1 xab", num_tokens=1) == ("1 ", False)  # "ab" ended too early
    assert matcher.process("z", num_tokens=2) == ("xabz", False)
    matcher = StopStringMatcher(["STOP"], min_tokens=2)
    assert matcher.process("a ST", num_tokens=1) == ("a ", False)
    assert matcher.process("OP b", num_tokens=2) == ("", True)  # ends after min_tokens


def test_possible_stop_prefix_is_held_back():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.process("Hello ST") == ("Hello ", False)


def test_partial_match_that_is_not_a_stop_is_released():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.process("Hello ST") == ("Hello ", False)
    assert matcher.process("OCK and STO") == ("STOCK and ", False)
    assert matcher.process("W") == ("STOW", False)
    assert matcher.flush() == ""


def test_no_stop_flush_returns_held_tail():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.process("42 </ans") == ("42 ", False)
    assert matcher.flush() == "</ans"


def test_held_back_text_is_at_most_longest_stop_minus_one():
    matcher = StopStringMatcher(["ab", "aaaa"])
    assert matcher.process("xaaaaaa"[:4]) == ("x", False)  # "aaa" could start "aaaa"
    assert matcher.max_held_chars == 3


def test_earliest_of_several_stops_wins():
    matcher = StopStringMatcher(["world", "lo"])
    assert stream_stop(matcher, ["hello world"]) == ("hel", True)
    assert matcher.matched_stop == "lo"


def test_stop_that_ends_first_wins_whatever_the_split():
    # "c" is complete before "abcde" is; a token-by-token check would stop at "c".
    for deltas in (["abcde"], ["abc", "de"], ["a", "b", "c", "d", "e"]):
        matcher = StopStringMatcher(["abcde", "c"])
        assert stream_stop(matcher, deltas) == ("ab", True)
        assert matcher.matched_stop == "c"


def test_longer_stop_wins_when_two_end_together():
    matcher = StopStringMatcher(["ond", "second"])
    assert stream_stop(matcher, ["first sec", "ond"]) == ("first ", True)
    assert matcher.matched_stop == "second"


def test_stop_at_very_start():
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.process("\n\nHello") == ("", True)


def test_after_stop_nothing_more_is_sent():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.process("a STOP b") == ("a ", True)
    assert matcher.process("more") == ("", True)
    assert matcher.flush() == ""


def test_duplicate_stops_are_merged():
    assert StopStringMatcher(["x", "x", "y"]).stop == ("x", "y")


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(["ok", ""])


def test_single_string_instead_of_list_is_rejected():
    with pytest.raises(TypeError, match="stop"):
        StopStringMatcher("STOP")


def test_non_string_stop_entry_is_rejected():
    with pytest.raises(TypeError, match="stop"):
        StopStringMatcher(["ok", 3])


# --- Both together, on real token streams -----------------------------------------------


@pytest.mark.parametrize(
    ("name", "stop"),
    [
        ("english", "lazy dog"),
        ("english", "over"),
        ("code", "\n\n"),
        ("code", "return"),
        ("cjk", "世界"),
        ("emoji", "🇫🇷"),
        ("accents", "à v"),
    ],
)
def test_detokenizer_then_stop_matcher_cuts_before_stop(tokenizer, chat_prompt_ids, name, stop):
    ids = encode(tokenizer, TEXTS[name])
    full_text = tokenizer.decode(ids)
    detok = IncrementalDetokenizer(tokenizer, chat_prompt_ids)
    matcher = StopStringMatcher([stop])
    sent, is_stopped = [], False
    for i in ids:
        safe, is_stopped = matcher.process(detok.add_tokens([i]))
        sent.append(safe)
        if is_stopped:
            break
    assert is_stopped
    assert "".join(sent) == full_text[: full_text.index(stop)]


def test_detokenizer_then_stop_matcher_without_stop_sends_everything(tokenizer):
    ids = encode(tokenizer, TEXTS["code"])
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    matcher = StopStringMatcher(["never there", "def add(a, c)"])
    sent = []
    for i in ids:
        safe, is_stopped = matcher.process(detok.add_tokens([i]))
        assert not is_stopped
        sent.append(safe)
    safe, is_stopped = matcher.process(detok.flush())
    sent += [safe, matcher.flush()]
    assert not is_stopped
    assert "".join(sent) == tokenizer.decode(ids)
