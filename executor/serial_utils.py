"""How a message crosses a process boundary: MessagePack for the typed messages, pickle for the rest.

Who calls it: the message queue (``MessageQueueWriter.enqueue`` encodes each message
once, for every reader; each ``MessageQueueReader.dequeue`` decodes it once), in any
thread. Both ends must run this same module. (The Ray executor and the torchrun
launcher pickle whole calls; the Structs pickle as their class and fields' tuple.)

One message on the wire is one of::

    0x80 ...          a pickle (protocol 5 begins with its PROTO opcode): any other object
    tag, msgpack      a typed message (``_MESSAGE_TAGS``): its Struct as a MessagePack array

A call's values, the items of ``RPCRequest.args``, the values of ``RPCRequest.kwargs``
and ``RPCReply.result``, may be anything; each crosses on its own:

* as itself if it is a plain scalar (None, bool, an int of 64 bits, float, str, bytes),
  which MessagePack gives back with its exact type;
* as a MessagePack ext holding the typed encoding if it is a step message
  (``SchedulerOutput``, ``ModelRunnerOutput``): the per-step ``execute_model`` call and
  its reply are MessagePack end to end, with no pickle anywhere;
* else as an ext holding its pickle (protocol 5, as the queue pickled whole messages
  before): tensors, containers (MessagePack would turn a tuple or a set into a list),
  exceptions. A callable sent by ``collective_rpc(fn)`` is already cloudpickled bytes
  in ``RPCRequest.method`` (``plan_call``).

A request's `SamplingParams` (in ``ScheduledRequest.sampling_params``, at its admission)
crosses as an ext of its fields' values, decoded with their annotated types, and is
rebuilt as pickle rebuilds a dataclass: without running ``__post_init__``, whose checks
(4 µs a request) the engine ran when it was made. So the ranks get an equal object and
no second warning (a temperature below 0.01 was raised to 0.01 already).

Encoding raises what pickle raises for a value it cannot pickle (TypeError for a lock),
before anything is sent. Decoding raises `MessageDecodeError` for bytes that are not a
message of this module (an unknown tag or ext code, truncated or malformed data, a
value of the wrong type), so a garbled chunk fails loudly at once instead of leaving a
caller to wait.
"""

from __future__ import annotations

import dataclasses
import operator
import pickle
import typing
from typing import Any

import msgspec

from config import SamplingParams
from executor.rpc import RPCReply, RPCRequest
from worker.outputs import ModelRunnerOutput, SchedulerOutput

__all__ = ["MessageDecodeError", "decode_message", "encode_message"]

_PICKLE_PROTO = 0x80  # the first byte of every pickle of protocol >= 2

# A typed message's first byte on the wire; the step messages' numbers are also their ext
# codes inside a call. Both ends must agree: never reuse a number for another type.
_MESSAGE_TAGS: dict[type, int] = {RPCRequest: 1, RPCReply: 2, SchedulerOutput: 3, ModelRunnerOutput: 4}
# Values of a call that cross typed. Not the envelopes: their own values would cross
# unwrapped, so a nested RPCRequest is pickled like any other object.
_VALUE_TAGS: dict[type, int] = {SchedulerOutput: 3, ModelRunnerOutput: 4}
_EXT_SAMPLING_PARAMS = 5  # a SamplingParams' field values, in its fields' order
_EXT_PICKLE = 127  # a value of a call, pickled

_SCALARS = frozenset({type(None), bool, int, float, str, bytes})
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what MessagePack can hold

_PARAM_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))
_param_values = operator.attrgetter(*_PARAM_NAMES)
_sampling_params_of = operator.attrgetter("sampling_params")


class MessageDecodeError(ValueError):
    """Bytes that do not decode to a message: unknown tag or ext code, or truncated,
    malformed or mistyped data (the cause is chained)."""


def _ext_hook(code: int, data: memoryview) -> Any:
    """A value inside a typed message (see the module docstring). ``data`` views the
    message's buffer (shared memory): it is released here, and what is returned is a copy."""
    with data:
        if code == _EXT_PICKLE:
            return pickle.loads(data)
        if code == _EXT_SAMPLING_PARAMS:
            params = SamplingParams.__new__(SamplingParams)
            params.__dict__.update(zip(_PARAM_NAMES, _param_decoder.decode(data)))
            return params
        decoder = _VALUE_DECODERS.get(code)
        if decoder is None:
            raise MessageDecodeError(f"unknown ext code {code} inside a message")
        return decoder.decode(data)


_encoder = msgspec.msgpack.Encoder()
_DECODERS: dict[int, msgspec.msgpack.Decoder] = {
    tag: msgspec.msgpack.Decoder(cls, ext_hook=_ext_hook) for cls, tag in _MESSAGE_TAGS.items()
}
_VALUE_DECODERS = {tag: _DECODERS[tag] for tag in _VALUE_TAGS.values()}
_NAMES = {tag: cls.__name__ for cls, tag in _MESSAGE_TAGS.items()}
_hints = typing.get_type_hints(SamplingParams)
_param_decoder = msgspec.msgpack.Decoder(tuple[tuple(_hints[name] for name in _PARAM_NAMES)])


def _params_ext(params: Any) -> msgspec.msgpack.Ext:
    """A request's SamplingParams as it crosses (a subclass, which the field order does
    not describe, is pickled)."""
    if type(params) is SamplingParams:
        return msgspec.msgpack.Ext(_EXT_SAMPLING_PARAMS, _encoder.encode(_param_values(params)))
    return msgspec.msgpack.Ext(_EXT_PICKLE, pickle.dumps(params, protocol=5))


def _wire_step(step: SchedulerOutput) -> SchedulerOutput:
    """A step with its requests' SamplingParams as they cross: a copy, made only for a
    step that admits requests (a decode step has none: one C-level scan)."""
    if not any(map(_sampling_params_of, step.scheduled)):
        return step
    scheduled = [req if req.sampling_params is None
                 else msgspec.structs.replace(req, sampling_params=_params_ext(req.sampling_params))
                 for req in step.scheduled]
    return msgspec.structs.replace(step, scheduled=scheduled)


def _wire_value(value: Any) -> Any:
    """One value of a call as it crosses: itself, or an ext (module docstring)."""
    kind = type(value)
    if kind in _SCALARS and (kind is not int or _INT_MIN <= value <= _INT_MAX):
        return value
    tag = _VALUE_TAGS.get(kind)
    if tag is not None:
        return msgspec.msgpack.Ext(tag, _encoder.encode(_wire_step(value) if kind is SchedulerOutput else value))
    return msgspec.msgpack.Ext(_EXT_PICKLE, pickle.dumps(value, protocol=5))


def _on_the_wire(message: Any) -> Any:
    """A typed message with its values as they cross (a copy where one changes: the
    caller's message is never modified)."""
    kind = type(message)
    if kind is RPCRequest:
        if message.args or message.kwargs:
            return msgspec.structs.replace(
                message, args=tuple(map(_wire_value, message.args)),
                kwargs={key: _wire_value(value) for key, value in message.kwargs.items()})
    elif kind is RPCReply:
        result = _wire_value(message.result)
        if result is not message.result:
            return msgspec.structs.replace(message, result=result)
    elif kind is SchedulerOutput:
        return _wire_step(message)
    return message


def encode_message(message: Any) -> bytes | bytearray:
    """The bytes of ``message``: tag + MessagePack for a typed message, else its pickle.

    Any thread; keeps nothing. Raises what pickle raises for a value that does not
    pickle (nothing was sent)."""
    tag = _MESSAGE_TAGS.get(type(message))
    if tag is None:
        return pickle.dumps(message, protocol=5)
    buffer = bytearray((tag,))
    _encoder.encode_into(_on_the_wire(message), buffer, 1)
    return buffer


def decode_message(buffer: memoryview | bytes | bytearray) -> Any:
    """The message that ``encode_message`` made these bytes of; ``buffer`` may view
    shared memory, which nothing returned keeps. Raises MessageDecodeError for bytes
    that are no such message."""
    with memoryview(buffer) as view:  # released even when a traceback keeps this frame
        if not view.nbytes:
            raise MessageDecodeError("an empty message")
        tag = view[0]
        if tag == _PICKLE_PROTO:
            try:
                return pickle.loads(view)
            except Exception as e:  # noqa: BLE001 - whatever garbled bytes make pickle raise
                raise MessageDecodeError(f"a pickled message of {view.nbytes} bytes does not unpickle: "
                                         f"{type(e).__name__}: {e}") from e
        decoder = _DECODERS.get(tag)
        if decoder is None:
            raise MessageDecodeError(f"unknown message tag {tag:#04x} ({view.nbytes} bytes): not a message of "
                                     "executor.serial_utils (a peer of another version, or a corrupted chunk)")
        with view[1:] as body:
            try:
                return decoder.decode(body)
            except MessageDecodeError:
                raise
            except Exception as e:  # noqa: BLE001 - msgspec's DecodeError, or a value's unpickling
                raise MessageDecodeError(f"an {_NAMES[tag]} of {view.nbytes} bytes does not decode: "
                                         f"{type(e).__name__}: {e}") from e
