"""Incremental detokenization (issue 38): a request's streamed pieces join to exactly the
whole decode and stop strings cut where one-token-at-a-time decoding of the whole text cuts,
for the fixture tokenizers (SentencePiece with byte fallback and the dummy-prefix space,
byte-level BPE), with token sequences holding byte-fallback CJK and emoji, words, newlines and
skipped special tokens, fed in blocks of random sizes; and the host work per token stays
bounded (no whole-text decode per block)."""
import random
from types import SimpleNamespace

import pytest
import torch

from realistic import FIXTURES, checkpoint
from tabed_engine.config import SamplingParams
from tabed_engine.engine.request import Request

_EXTRA = ["中", "文", "字", "😀", "🚲", "é", "ü", "ß", "\n", "\n\n", " ", "  ", "3", "42", ".", ",", "?",
          "'s"]


@pytest.fixture(scope="module", params=list(FIXTURES))
def tok(request):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint(request.param)[0], local_files_only=True)


def random_ids(tok, rng: random.Random, n_words: int) -> list[int]:
    """Ids of a text of words, CJK, emoji, accents, newlines and digits, with a few special
    tokens (skipped in the text) dropped in."""
    from realistic import _WORDS

    parts = [rng.choice(_WORDS) if rng.random() < 0.6 else rng.choice(_EXTRA) for _ in range(n_words)]
    text = "".join(p if rng.random() < 0.3 else " " + p for p in parts)
    ids = tok.encode(text, add_special_tokens=False)
    specials = [tok.convert_tokens_to_ids(t) for t in ("<image>", "<pad>")]
    for _ in range(rng.randint(0, 3)):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
    return ids


def make_request(tok, n: int, stop=()) -> Request:
    sp = SamplingParams(max_new_tokens=n, stop_at_eos=False, stop=tuple(stop))
    return Request("r", SimpleNamespace(ids=[0]), sp, None, False, torch.Generator(), tok, frozenset(), max_new=n)


def feed(req: Request, ids: list[int], rng: random.Random) -> list[str]:
    """Append ids in blocks of 1..6 tokens as the runner does, taking a piece after each."""
    pieces, i = [], 0
    while not req.finished:
        k = rng.randint(1, 6)
        req.append(ids[i:i + k])
        i += k
        pieces.append(req.piece())
    return pieces


def reference_stop(tok, ids: list[int], stops) -> tuple[int, str]:
    """One token at a time, the whole text decoded after each: (tokens kept, final text)."""
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1], skip_special_tokens=True)
        cut = min((j for j in (text.find(s) for s in stops) if j >= 0), default=-1)
        if cut >= 0:
            return i + 1, text[:cut]
    return len(ids), tok.decode(ids, skip_special_tokens=True)


def test_pieces_join_to_the_whole_decode(tok):
    rng = random.Random(0)
    for trial in range(40):
        ids = random_ids(tok, rng, rng.randint(1, 40))
        if trial % 2:                 # max_new_tokens may end the text inside a character
            ids = ids[:rng.randint(1, len(ids))]
        req = make_request(tok, len(ids))
        pieces = feed(req, ids, rng)
        whole = tok.decode(ids, skip_special_tokens=True)
        assert req.tokens == ids and req.finish_reason == "length"
        assert "".join(pieces) == whole == req.output().text, (trial, pieces, whole)


def test_pieces_while_running_are_final(tok):
    """Every piece shown before the end is a prefix of the final text at once (a byte group or
    a UTF-8 sequence cut by a block boundary is held back, not shown as U+FFFD), and text is
    shown as soon as it is final: all of it when the block does not end inside a character."""
    rng = random.Random(1)
    eager = 0
    for _ in range(20):
        ids = random_ids(tok, rng, 30)
        whole = tok.decode(ids, skip_special_tokens=True)
        req = make_request(tok, len(ids))
        shown, i = "", 0
        while not req.finished:
            k = rng.randint(1, 6)
            req.append(ids[i:i + k])
            i += k
            shown += req.piece()
            assert whole.startswith(shown), (shown, whole)
            assert "\ufffd" not in shown
            now = tok.decode(ids[:i], skip_special_tokens=True)
            last = tok.convert_ids_to_tokens(ids[min(i, len(ids)) - 1])
            if not req.finished and not now.endswith("\ufffd") and not (last.startswith("<0x") and len(last) == 6):
                assert shown == now, (shown, now)
                eager += 1
    assert eager >= 20


def test_stop_strings_cut_as_one_token_at_a_time(tok):
    rng = random.Random(2)
    for trial in range(30):
        ids = random_ids(tok, rng, 30)
        whole = tok.decode(ids, skip_special_tokens=True)
        # stop strings cut out of the text: they cross tokens, blocks, multi-byte characters
        stops = []
        for _ in range(rng.randint(1, 2)):
            a = rng.randrange(max(len(whole) - 1, 1))
            stops.append(whole[a:a + rng.randint(1, 5)] or "x")
        if rng.random() < 0.3:
            stops.append("\u00a7never")
        n_keep, text = reference_stop(tok, ids, stops)
        req = make_request(tok, len(ids), stops)
        pieces = feed(req, ids, rng)
        out = req.output()
        assert out.token_ids == ids[:n_keep], (trial, stops)
        assert out.text == text, (trial, stops, out.text, text)
        assert out.finish_reason == ("stop" if n_keep < len(ids) or any(s in whole for s in stops) else "length")
        assert "".join(pieces) == text
        assert not any(s in "".join(pieces[:-1]) for s in stops)


@pytest.mark.parametrize("text", ["a\n😀", "a\n中", "é😀"])
def test_text_ending_inside_a_character(tok, text):
    """The text ends (max_new_tokens) inside a character whose byte group follows complete
    characters: with byte fallback the whole group then decodes as U+FFFD, so what was shown
    must not have included its complete characters either."""
    ids = tok.encode(text, add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        for k in (1, 2):
            req = make_request(tok, n)
            pieces, i = [], 0
            while not req.finished:
                req.append(ids[i:i + k])
                i += k
                pieces.append(req.piece())
            assert "".join(pieces) == tok.decode(ids[:n], skip_special_tokens=True), (n, k, pieces)


def test_stop_string_inside_a_byte_group(tok):
    """A stop string that is one multi-byte character, completed by a later block: found at the
    token that completes it, not before."""
    ids = tok.encode(" the cat 中 sat", add_special_tokens=False)
    n_keep, text = reference_stop(tok, ids, ["中"])
    assert text.strip() == "the cat" and n_keep < len(ids)
    for k in range(1, 4):
        req = make_request(tok, len(ids), ["中"])
        pieces = []
        for i in range(0, len(ids), k):
            req.append(ids[i:i + k])
            pieces.append(req.piece())
            if req.finished:
                break
        assert req.tokens == ids[:n_keep] and req.output().text == text == "".join(pieces)


def test_host_work_per_token_is_bounded(tok):
    """The ids decoded per generated token stay bounded as the text grows (the whole text
    decoded every block or every token would grow with it), with and without stop strings."""
    rng = random.Random(3)
    ids = random_ids(tok, rng, 400)
    for stops in ((), ("\u00a7never",)):
        decoded = []
        inner = tok.decode

        class Counting:
            def __getattr__(self, name):
                return getattr(tok, name)

            def decode(self, x, **kw):
                decoded.append(len(x))
                return inner(x, **kw)

        req = make_request(Counting(), len(ids), stops)
        pieces = feed(req, ids, rng)
        during = sum(decoded) - len(ids)          # less the one whole decode at the end
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
        assert during <= 30 * len(ids), (during, len(ids))
        assert max(decoded[:-1]) <= 60, max(decoded[:-1])
