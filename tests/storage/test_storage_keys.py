"""Storage keys: stable across processes, separated by namespace, chainable, whole pages only."""

import hashlib
import struct
import subprocess
import sys

import pytest

from radixkv_server.core.pages import pack
from radixkv_server.storage import KEY_BYTES, namespace_salt, page_keys

PAGE = 4
SALT = namespace_salt("llama3-8b", "bf16/L32/H8/D128/P4")
PROMPT = pack(range(1000, 1000 + 10 * PAGE))  # ten whole pages


def test_same_tokens_and_salt_give_same_keys_in_another_process():
    code = (
        "from radixkv_server.storage import namespace_salt, page_keys;"
        "from radixkv_server.core.pages import pack;"
        f"s = namespace_salt('llama3-8b', 'bf16/L32/H8/D128/P4');"
        f"print(','.join(k.hex() for k in page_keys(s, pack(range(1000, {1000 + 10 * PAGE})), {PAGE})))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    keys = page_keys(SALT, PROMPT, PAGE)
    assert out.stdout.strip().split(",") == [k.hex() for k in keys]
    assert keys == page_keys(SALT, bytearray(PROMPT), PAGE)
    assert len(keys) == 10 and all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 10


def test_keys_follow_the_documented_byte_layout():
    def h(data):
        return hashlib.blake2b(data, digest_size=32).digest()

    def field(data):
        return struct.pack("<I", len(data)) + data

    salt = h(b"radixkv/namespace/v1\x00" + field(b"m") + field(b"fp"))
    assert namespace_salt("m", "fp") == salt
    prefix = b"radixkv/page/v1\x00" + field(salt) + field(b"lora-7")
    prev, expected = bytes(32), []
    for i in range(0, len(PROMPT), PAGE * 4):
        prev = h(prefix + prev + PROMPT[i:i + PAGE * 4])
        expected.append(prev)
    assert page_keys(salt, PROMPT, PAGE, extra_key=b"lora-7") == expected


@pytest.mark.parametrize("other", [
    namespace_salt("llama3-70b", "bf16/L32/H8/D128/P4"),   # another model
    namespace_salt("llama3-8b", "fp8/L32/H8/D128/P4"),     # another layout
])
def test_different_salt_gives_different_keys(other):
    assert other != SALT
    assert not set(page_keys(other, PROMPT, PAGE)) & set(page_keys(SALT, PROMPT, PAGE))


def test_salt_fields_cannot_run_into_each_other():
    assert namespace_salt("ab", "c") != namespace_salt("a", "bc")


def test_different_extra_key_gives_different_keys():
    plain = page_keys(SALT, PROMPT, PAGE)
    lora_a = page_keys(SALT, PROMPT, PAGE, extra_key=b"lora-a")
    lora_b = page_keys(SALT, PROMPT, PAGE, extra_key=b"lora-b")
    assert not set(plain) & set(lora_a)
    assert not set(lora_a) & set(lora_b)


@pytest.mark.parametrize("split_pages", [1, 3, 9])
@pytest.mark.parametrize("extra_key", [b"", b"lora-a"])
def test_chaining_with_start_equals_whole_prompt(split_pages, extra_key):
    whole = page_keys(SALT, PROMPT, PAGE, extra_key)
    cut = split_pages * PAGE * 4
    head = page_keys(SALT, PROMPT[:cut], PAGE, extra_key)
    tail = page_keys(SALT, PROMPT[cut:], PAGE, extra_key, start=head[-1])
    assert head + tail == whole


def test_key_names_the_whole_prefix():
    changed = bytearray(PROMPT)
    changed[2 * PAGE * 4] ^= 1  # first token of page 2
    a, b = page_keys(SALT, PROMPT, PAGE), page_keys(SALT, bytes(changed), PAGE)
    assert a[:2] == b[:2]
    assert not set(a[2:]) & set(b[2:])


def test_partial_trailing_page_is_ignored():
    ragged = PROMPT[: 3 * PAGE * 4 + 4 * 2]  # three pages and two tokens
    assert page_keys(SALT, ragged, PAGE) == page_keys(SALT, PROMPT, PAGE)[:3]
    assert page_keys(SALT, PROMPT[: (PAGE - 1) * 4], PAGE) == []
    assert page_keys(SALT, b"", PAGE) == []


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="multiple of 4"):
        page_keys(SALT, b"\x00" * 6, PAGE)
    with pytest.raises(ValueError, match="page_size"):
        page_keys(SALT, PROMPT, 0)
    with pytest.raises(ValueError, match="32-byte key"):
        page_keys(SALT, PROMPT, PAGE, start=b"short")
    with pytest.raises(ValueError, match="model"):
        namespace_salt("", "fp")
    with pytest.raises(TypeError):
        namespace_salt(b"model", "fp")
