"""pydantic models of posenc.v1's messages in their proto3 JSON form, built from the .proto's descriptors.

The /v1/posenc/... routes take and give the messages as JSON (google.protobuf.json_format): these models check a
body field by field before it is parsed (a bad field is 400 naming it, from the one place every route's bodies are
checked: service.http.errors.validated) and describe both directions in GET /openapi.json.  Built from the
descriptors, they cannot disagree with the .proto: a field added there is a field here.

proto3 JSON: a field is accepted by its .proto name or its lowerCamelCase JSON name; 64-bit integers may come as
strings (and are printed as strings); bytes are base64; an enum is its name or its number; unknown fields are
refused, as json_format refuses them."""

from __future__ import annotations

import functools
from types import GenericAlias
from typing import Annotated, Any, Literal

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, create_model

F = FieldDescriptor
INT32 = {F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32, F.TYPE_UINT32, F.TYPE_FIXED32}
INT64 = {F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64, F.TYPE_UINT64, F.TYPE_FIXED64}
DIGITS = Annotated[str, Field(pattern=r"^-?[0-9]+$")]
FLOAT_WORDS = Literal["NaN", "Infinity", "-Infinity"]


def _scalar(field: FieldDescriptor) -> Any:
    if field.type in INT32:
        return Annotated[int, Field(strict=True)]
    if field.type in INT64:
        return Annotated[int, Field(strict=True)] | DIGITS
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return float | FLOAT_WORDS
    if field.type == F.TYPE_BOOL:
        return Annotated[bool, Field(strict=True)]
    if field.type == F.TYPE_STRING:
        return Annotated[str, Field(strict=True)]
    if field.type == F.TYPE_BYTES:
        return Annotated[str, Field(strict=True, description="base64")]
    if field.type == F.TYPE_ENUM:
        return Literal[tuple(v.name for v in field.enum_type.values)] | Annotated[int, Field(strict=True)]
    return model_for(field.message_type)


def _is_map(field: FieldDescriptor) -> bool:
    entry: bool = field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry
    return entry


def _annotation(field: FieldDescriptor) -> Any:
    if _is_map(field):
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        # built at run time from the descriptors: dict[str, <the value's type>], list[<the element's type>]
        return GenericAlias(dict, (str, _scalar(value))) if key else dict[str, Any]
    if field.is_repeated:
        return GenericAlias(list, (_scalar(field),))
    return _scalar(field)


@functools.cache
def model_for(descriptor: Descriptor) -> type[BaseModel]:
    """The pydantic model of one message (cached: each message has one model, shared by those that nest it)."""
    fields: dict[str, Any] = {}
    for f in descriptor.fields:
        alias = AliasChoices(f.name, f.json_name) if f.json_name != f.name else None
        fields[f.name] = (_annotation(f) | None, Field(None, validation_alias=alias))
    name = descriptor.full_name.replace(".", "_")
    return create_model(name, __config__=ConfigDict(extra="forbid", title=descriptor.name), __doc__=(
        f"posenc.v1 {descriptor.name} in proto3 JSON form"), **fields)
