import subprocess
import sys

import pytest

from model import tokenizer


@pytest.mark.parametrize("text", ["hello, world", "", "naïve café", "位置编码", "emoji 🙂 ok", "tab\tnew\nline"])
def test_roundtrip(text):
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tokenizer.VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text


def test_decode_partial_utf8_never_raises():
    ids = tokenizer.encode("中")[:2]
    assert tokenizer.decode(ids) == "\ufffd"


@pytest.mark.parametrize("bad", [256, -1, True, 1.5, "a"])
def test_bad_ids_rejected(bad):
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tokenizer.decode([65, bad])


def test_display_forms():
    assert tokenizer.display(ord("a")) == "a"
    assert tokenizer.display(ord(" ")) == "␠"
    assert tokenizer.display(ord("\n")) == "\\n"
    assert tokenizer.display(0x07) == "<07>"
    lead, cont = tokenizer.encode("中")[:2]
    assert tokenizer.display(lead) == "<E4 1/3>"
    assert tokenizer.display(cont) == "<B8 cont>"
    assert tokenizer.display(0xFF) == "<FF>"


def test_pieces_name_the_character_on_every_byte():
    ids = tokenizer.encode("a中")
    assert tokenizer.pieces(ids) == ["a", "<E4 1/3 中>", "<B8 2/3 中>", "<AD 3/3 中>"]
    # a truncated character keeps the per-byte display
    assert tokenizer.pieces(ids[:3]) == ["a", "<E4 1/3>", "<B8 cont>"]
    assert len(tokenizer.pieces(tokenizer.encode("位置🙂"))) == len("位置🙂".encode())


def test_tokenizer_and_config_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import model.tokenizer, model.config\n"
            "print(model.config.preset('tiny', 'alibi').context, model.tokenizer.encode('ok'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "16 [111, 107]"
