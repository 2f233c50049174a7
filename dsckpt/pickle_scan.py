"""What a pickle would build, counted from its opcodes before it is parsed (:func:`prescan`).

The C unpickler builds whatever the opcode stream says, and one opcode of one byte (``]``: an empty list, ``}``: an
empty dict, ``h``: one more reference to a memoised object) costs 8-100 bytes of memory, a ``LONG_BINPUT`` of five
bytes a memo table of up to 2^33 slots. :func:`prescan` walks the opcodes once, keeping only the stack's depth and
its marks (never the objects), and counts the objects each opcode creates and the bytes they take -- containers,
their slots (a reference to a shared object included), strings and bytes, numbers, the memo table, the stack -- so
that a pickle past ``max_objects`` or ``max_parsed_nbytes`` (:mod:`dsckpt.limits`) is refused before anything is
built. What an allow-listed call copies from its arguments (``bytearray(b)``, ``set(l)``, a stand-in's state) is
counted by the call itself, before it copies (:func:`dsckpt.limits.charge_parsed`).

The byte counts are CPython 3.11's object sizes rounded up (a dict entry as a dict that has just doubled), so the
estimate is above what the unpickler then takes. An opcode the scanner does not know, or an argument running past
the end, stops the scan: the unpickler fails at the same place.
"""

from __future__ import annotations

import struct
from typing import cast

from . import limits

__all__ = ["prescan"]

# Bytes of memory, rounded up (sys.getsizeof on CPython 3.11, plus the 16-byte GC header of containers).
_NUMBER = 32  # an int (up to 60 bits), a float
_STR = 80  # a str, before its characters (up to 4 bytes each: UCS-4; UTF-8 bytes in the pickle are >= 1 per char)
_BYTES = 40
_CONTAINER = 80  # an empty list/dict/set/tuple with its GC header
_LIST_SLOT = 16  # a reference in a list (growth over-allocates by up to 1/8; 2x keeps a margin), a tuple
_DICT_ITEM = 104  # a key and value in a dict: entry (24) + index + the empty half of a table that just doubled, x2
_SET_ITEM = 64
_CALL = 640  # what a REDUCE / NEWOBJ / BUILD builds itself: a TensorRef with its shape, stride and attrs dict
_MEMO_SLOT = 16  # the C unpickler's memo is an array of references, doubled past the highest index written
_MEMO_ENTRY = 112  # the pure-Python (legacy) unpickler's memo is a dict

# Opcode kinds.
(_PUSH, _OBJ, _STRING, _CONTAINER_OP, _MARK, _POP, _POP_MARK, _APPEND, _APPENDS, _SETITEM, _SETITEMS, _ADDITEMS,
 _TO_MARK, _TUPLE_N, _CALL_OP, _PUT, _MEMOIZE, _STOP, _FRAME, _SKIP) = range(20)

# opcode -> (kind, fixed argument bytes, extra): extra is the struct format of a length prefix (_STRING), the
# number of items popped (_TUPLE_N, _CALL_OP), or the container built from the items above a mark (_TO_MARK).
_OPS: dict[int, tuple[int, int, object]] = {}


def _op(codes: bytes, kind: int, nargs: int = 0, extra: object = None) -> None:
    for c in codes:
        _OPS[c] = (kind, nargs, extra)


_op(b"(", _MARK)
_op(b".", _STOP)
_op(b"0", _POP)
_op(b"1", _POP_MARK)
_op(b"2", _PUSH)  # DUP
_op(b"N\x88\x89", _PUSH)  # None, True, False: singletons
_op(b"J", _OBJ, 4)
_op(b"K", _OBJ, 1)
_op(b"M", _OBJ, 2)
_op(b"G", _OBJ, 8)
_op(b"h", _PUSH, 1)  # BINGET
_op(b"j", _PUSH, 4)  # LONG_BINGET
_op(b"\x82", _PUSH, 1)  # EXT1 (the copyreg registry: existing objects)
_op(b"\x83", _PUSH, 2)
_op(b"\x84", _PUSH, 4)
_op(b"T", _STRING, 0, ("<I", _STR))  # BINSTRING (a str in Python 3)
_op(b"U", _STRING, 0, ("<B", _STR))
_op(b"X", _STRING, 0, ("<I", _STR))  # BINUNICODE
_op(b"\x8c", _STRING, 0, ("<B", _STR))
_op(b"\x8d", _STRING, 0, ("<Q", _STR))
_op(b"B", _STRING, 0, ("<I", _BYTES))
_op(b"C", _STRING, 0, ("<B", _BYTES))
_op(b"\x8e", _STRING, 0, ("<Q", _BYTES))
_op(b"\x96", _STRING, 0, ("<Q", _BYTES))  # BYTEARRAY8
_op(b"\x8a", _STRING, 0, ("<B", _NUMBER))  # LONG1: an int of that many bytes
_op(b"\x8b", _STRING, 0, ("<I", _NUMBER))
_op(b"]})\x8f", _CONTAINER_OP)  # EMPTY_LIST, EMPTY_DICT, EMPTY_TUPLE, EMPTY_SET
_op(b"a", _APPEND)
_op(b"e", _APPENDS)
_op(b"s", _SETITEM)
_op(b"u", _SETITEMS)
_op(b"\x90", _ADDITEMS)
_op(b"l", _TO_MARK, 0, _LIST_SLOT)  # LIST
_op(b"t", _TO_MARK, 0, _LIST_SLOT)  # TUPLE
_op(b"\x91", _TO_MARK, 0, _SET_ITEM)  # FROZENSET
_op(b"d", _TO_MARK, 0, _DICT_ITEM // 2)  # DICT: two items per entry
_op(b"\x85", _TUPLE_N, 0, 1)
_op(b"\x86", _TUPLE_N, 0, 2)
_op(b"\x87", _TUPLE_N, 0, 3)
_op(b"R", _CALL_OP, 0, 2)  # REDUCE: callable, args -> result
_op(b"\x81", _CALL_OP, 0, 2)  # NEWOBJ
_op(b"\x92", _CALL_OP, 0, 3)  # NEWOBJ_EX
_op(b"b", _CALL_OP, 0, 2)  # BUILD: object, state -> object
_op(b"\x93", _CALL_OP, 0, 2)  # STACK_GLOBAL: module, name -> an allow-listed object (counted as a call: cheap)
_op(b"Q", _CALL_OP, 0, 1)  # BINPERSID: a storage
_op(b"o", _CALL_OP, 0, -1)  # OBJ: everything above the mark
_op(b"q", _PUT, 1)
_op(b"r", _PUT, 4)
_op(b"\x94", _MEMOIZE)
_op(b"\x80", _SKIP, 1)  # PROTO
_op(b"\x95", _FRAME, 8)
_OPS_BY_CODE: tuple[tuple[int, int, object] | None, ...] = tuple(_OPS.get(c) for c in range(256))
# Protocol 0 opcodes with a text argument ending in a newline: handled by _line_op.
_LINE_OPS = {ord(c): k for c, k in [("I", "obj"), ("F", "obj"), ("L", "long"), ("S", "str"), ("V", "str"),
                                     ("g", "get"), ("p", "put"), ("P", "persid"), ("c", "global"),
                                     ("i", "inst")]}


def prescan(data: bytes | bytearray | memoryview, where: object, *, dict_memo: bool = False) -> tuple[int, bool]:
    """Estimated bytes of memory unpickling ``data`` builds, and whether its STOP was reached (False: ``data``
    ends first, or holds what is not an opcode); raises
    :class:`~dsckpt.limits.LimitExceededError` naming ``where`` when it passes ``max_objects`` or
    ``max_parsed_nbytes`` (or holds one string past ``max_str_nbytes``, one integer past ``max_int_bits``),
    as soon as the scan gets there. ``dict_memo``: the pure-Python unpickler's memo (a dict), not the C one's
    array. Scans the first pickle only (up to STOP)."""
    lim = limits.current()
    max_nbytes, max_objects, max_str = lim.max_parsed_nbytes, lim.max_objects, lim.max_str_nbytes
    raw = data if isinstance(data, bytes) else bytes(data)
    end = len(raw)
    ops = _OPS_BY_CODE
    unpack_from = struct.unpack_from
    nbytes = 0
    objects = 0
    depth = 0  # items on the stack above the bottom
    marks: list[int] = []  # the depth at each MARK
    high = 0  # the highest depth plus the most marks (the stack's own memory)
    high_marks = 0
    memo_top = -1  # the highest memo index written
    memo_count = 0
    pos = 0
    stopped = False
    check_at = 1 << 16  # compare with the budgets every so many bytes of pickle (and at the end)
    while pos < end:
        code = raw[pos]
        pos += 1
        spec = ops[code]
        if spec is None:
            if code not in _LINE_OPS:
                break  # not an opcode: the unpickler refuses it here
            nl = raw.find(b"\n", pos, pos + (1 << 20))
            if nl < 0:
                break
            line_kind = _LINE_OPS[code]
            arg_len = nl - pos
            pos = nl + 1
            if line_kind in ("global", "inst"):
                nl = raw.find(b"\n", pos, pos + (1 << 20))
                if nl < 0:
                    break
                pos = nl + 1
            if line_kind == "put":
                memo_count += 1
                try:
                    memo_top = max(memo_top, int(raw[pos - arg_len - 1:pos - 1]))
                except ValueError:
                    break
            elif line_kind == "inst":
                if marks:
                    depth = marks.pop()
                depth += 1
                objects += 1
                nbytes += _CALL
            elif line_kind == "persid":
                depth += 1
                nbytes += _CALL
            elif line_kind in ("get", "global"):
                depth += 1
            else:
                depth += 1
                objects += 1
                nbytes += (_STR if line_kind == "str" else _NUMBER) + arg_len
            continue
        kind, nargs, extra = spec
        if kind == _PUT:
            idx = raw[pos] if nargs == 1 else unpack_from("<I", raw, pos)[0]
            pos += nargs
            memo_count += 1
            if idx > memo_top:
                memo_top = idx
                if (memo_top + 1) * _MEMO_SLOT > max_nbytes and not dict_memo:
                    raise limits.exceeded(where, f"a pickle memo index of {idx}", None, "max_parsed_nbytes")
            continue
        if kind == _PUSH:
            depth += 1
            pos += nargs
            # A run of one reference repeated ("h\x01" x 10^7, or "h\x01a": appended each time) is counted at
            # the speed of comparing bytes, not one loop per opcode.
            if pos < end and raw[pos] in (code, 97):  # the same opcode again, or APPEND ("a")
                unit = raw[pos - nargs - 1:pos]
                if raw.startswith(unit, pos):
                    n, pos = _repeats(raw, pos, unit)
                    depth += n
                elif raw.startswith(unit, pos + 1) and raw.startswith(unit + b"a", pos + 1):
                    n, pos = _repeats(raw, pos + 1, unit + b"a")
                    nbytes += (n + 1) * _LIST_SLOT
                    depth -= 1
        elif kind == _APPENDS or kind == _SETITEMS or kind == _ADDITEMS:
            mark = marks.pop() if marks else 0
            n = depth - mark
            depth = mark
            nbytes += n * (_LIST_SLOT if kind == _APPENDS else _DICT_ITEM // 2 if kind == _SETITEMS else _SET_ITEM)
        elif kind == _MEMOIZE:
            memo_count += 1
            memo_top = max(memo_top, memo_count - 1)
        elif kind == _OBJ:
            depth += 1
            objects += 1
            nbytes += _NUMBER
            pos += nargs
        elif kind == _STRING:
            fmt, base = cast("tuple[str, int]", extra)
            size = struct.calcsize(fmt)
            if pos + size > end:
                break
            (n,) = unpack_from(fmt, raw, pos)
            pos += size + n
            if pos > end:
                break  # the unpickler refuses a length past the end
            if base != _NUMBER and n > max_str:
                raise limits.exceeded(where, f"a string or bytes of {n} bytes", None, "max_str_nbytes")
            if base == _NUMBER and n * 8 > lim.max_int_bits:
                raise limits.exceeded(where, f"an integer of {n * 8} bits", None, "max_int_bits")
            depth += 1
            objects += 1
            nbytes += base + n
        elif kind == _CONTAINER_OP:
            depth += 1
            objects += 1
            nbytes += _CONTAINER
        elif kind == _APPEND or kind == _SETITEM:
            depth -= 1 if kind == _APPEND else 2
            nbytes += _LIST_SLOT if kind == _APPEND else _DICT_ITEM
        elif kind == _MARK:
            marks.append(depth)
            high_marks = max(high_marks, len(marks))
        elif kind == _TO_MARK:
            mark = marks.pop() if marks else 0
            n = depth - mark
            depth = mark + 1
            objects += 1
            nbytes += _CONTAINER + n * extra  # type: ignore[operator]
        elif kind == _TUPLE_N:
            depth -= extra - 1  # type: ignore[operator]
            objects += 1
            nbytes += _CONTAINER + extra * _LIST_SLOT  # type: ignore[operator]
        elif kind == _CALL_OP:
            if extra == -1:
                depth = (marks.pop() if marks else 0) + 1
            else:
                depth -= extra - 1  # type: ignore[operator]
            objects += 1
            nbytes += _CALL
        elif kind == _POP:
            if marks and depth == marks[-1]:
                marks.pop()
            else:
                depth -= 1
        elif kind == _POP_MARK:
            depth = marks.pop() if marks else 0
        elif kind == _STOP:
            stopped = True
            break
        else:  # _SKIP, _FRAME
            pos += nargs
        if depth > high:
            high = depth
        if pos >= check_at:
            check_at = pos + (1 << 16)
            _check(where, objects, nbytes + _overhead(high + high_marks, memo_top, memo_count, dict_memo), max_objects,
                   max_nbytes)
    total = nbytes + _overhead(high + high_marks, memo_top, memo_count, dict_memo)
    _check(where, objects, total, max_objects, max_nbytes)
    return total, stopped


def _repeats(raw: bytes, pos: int, unit: bytes) -> tuple[int, int]:
    """How many times ``unit`` repeats from ``pos`` on, and where the run ends (chunks doubled and halved)."""
    n, k, chunk = 0, 1, unit
    while True:
        if raw.startswith(chunk, pos):
            pos += len(chunk)
            n += k
            if k < 1 << 16:
                chunk += chunk
                k *= 2
        elif k > 1:
            k //= 2
            chunk = chunk[: len(chunk) // 2]
        else:
            return n, pos


def _overhead(high: int, memo_top: int, memo_count: int, dict_memo: bool) -> int:
    memo = memo_count * _MEMO_ENTRY if dict_memo else 2 * (memo_top + 1) * _MEMO_SLOT
    return 2 * high * 8 + memo


def _check(where: object, objects: int, nbytes: int, max_objects: int, max_nbytes: int) -> None:
    if objects > max_objects:
        raise limits.exceeded(where, f"a pickle building more than {max_objects} objects", None, "max_objects")
    if nbytes > max_nbytes:
        raise limits.exceeded(where, f"a pickle building about {nbytes} bytes of objects", None, "max_parsed_nbytes")
