"""Hypothesis strategies derived from protobuf descriptors, and byte-level mutations.

`messages(descriptor, hints)` draws messages of any type by walking `DESCRIPTOR.fields`:
every scalar type over its whole range (biased towards the edges hypothesis likes),
strings and bytes, enums (known values and unknown numbers), nested messages (to a
depth), repeated fields and maps. `hints` maps a field name to a strategy (or to
{kind: strategy}, see `kind`) drawn instead half of the time (live session ids, packed
int32 page lists, small node ids), so that generated requests get past the first check
and reach deeper code.

`mutated(raw)` draws byte-level mutations of a serialized message: bit flips, bytes
overwritten, deleted, inserted or duplicated, truncation.
"""

from hypothesis import strategies as st
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F

MAX_DEPTH = 3
MAX_REPEATED = 4

_INTS = {
    F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1), F.TYPE_SFIXED32: (-2**31, 2**31 - 1),
    F.TYPE_INT64: (-2**63, 2**63 - 1), F.TYPE_SINT64: (-2**63, 2**63 - 1), F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}


def scalar(field) -> st.SearchStrategy:
    """Any value of a non-message field's type."""
    t = field.type
    if t in _INTS:
        lo, hi = _INTS[t]
        return st.one_of(st.integers(max(lo, -4), min(hi, 64)), st.integers(lo, hi))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_FLOAT:
        return st.floats(width=32)
    if t == F.TYPE_DOUBLE:
        return st.floats()
    if t == F.TYPE_STRING:
        return st.text(max_size=40)
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-2**31, 2**31 - 1))
    raise TypeError(f"no strategy for field {field.full_name} of type {t}")


def kind(field) -> str:
    """"int", "bool", "float", "str", "bytes", "enum" or "msg": what a hint must draw."""
    t = field.type
    if t in _INTS:
        return "int"
    return {F.TYPE_BOOL: "bool", F.TYPE_FLOAT: "float", F.TYPE_DOUBLE: "float", F.TYPE_STRING: "str",
            F.TYPE_BYTES: "bytes", F.TYPE_ENUM: "enum", F.TYPE_MESSAGE: "msg"}[t]


def messages(descriptor, hints: dict | None = None, depth: int = 0) -> st.SearchStrategy:
    """Messages of `descriptor`'s type, each field set or left unset at random."""
    hints = hints or {}
    cls = message_factory.GetMessageClass(descriptor)
    fields = {}
    for f in descriptor.fields:
        if f.type == F.TYPE_MESSAGE and depth >= MAX_DEPTH:
            continue
        # A hinted field is always set (hint or any value); others are unset half the time.
        fields[f.name] = _field(f, hints, depth) if f.name in hints else st.one_of(st.none(), _field(f, hints, depth))
    return st.fixed_dictionaries(fields).map(lambda values: _build(cls, descriptor, values))


def _field(f, hints: dict, depth: int) -> st.SearchStrategy:
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        value_s = messages(value.message_type, hints, depth + 1) if value.type == F.TYPE_MESSAGE else scalar(value)
        return st.dictionaries(scalar(key), value_s, max_size=MAX_REPEATED)
    one = messages(f.message_type, hints, depth + 1) if f.type == F.TYPE_MESSAGE else scalar(f)
    hint = hints.get(f.name)
    if isinstance(hint, dict):  # by kind of field: one name may be a bool here, an id there
        hint = hint.get(kind(f))
    if hint is not None:
        one = st.one_of(hint, one)
    if f.is_repeated:
        return st.lists(one, max_size=MAX_REPEATED)
    return one


def _build(cls, descriptor, values: dict):
    msg = cls()
    for name, value in values.items():
        if value is None:
            continue
        f = descriptor.fields_by_name[name]
        target = getattr(msg, name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            for k, v in value.items():
                if f.message_type.fields_by_name["value"].type == F.TYPE_MESSAGE:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif f.is_repeated:
            if f.type == F.TYPE_MESSAGE:
                for v in value:
                    target.add().CopyFrom(v)
            else:
                target.extend(value)
        elif f.type == F.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


@st.composite
def mutated(draw, raw: bytes) -> bytes:
    """`raw` with 1-4 byte-level mutations."""
    data = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "delete", "insert", "duplicate", "truncate"]))
        at = draw(st.integers(0, len(data))) if data else 0
        if op == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and at < len(data):
            data[at] = draw(st.sampled_from([0x00, 0x7f, 0x80, 0xff, draw(st.integers(0, 255))]))
        elif op == "delete":
            del data[at:at + draw(st.integers(1, 8))]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "duplicate":
            end = min(len(data), at + draw(st.integers(1, 16)))
            data[at:at] = data[at:end]
        elif op == "truncate":
            del data[at:]
    return bytes(data)


__all__ = ["kind", "messages", "mutated", "scalar"]
