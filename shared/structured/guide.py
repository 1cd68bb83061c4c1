"""A byte-level pushdown automaton over a compiled spec (``schema.py``): which bytes may come next.

A state is a tuple of stacks (more than one only where the spec leaves a choice open, as a union
of two object schemas does until a key tells them apart), each stack a tuple of frames, the last
the innermost. Frames are small tuples whose first item is their kind:

- ``(VALUE, node, ws)``: a value of ``node`` starts here (after up to ``ws`` whitespace bytes);
- ``(STR, node, chars, mode)``: inside a string, ``chars`` characters written (counted only
  where the node bounds them); ``mode`` 0 between characters, else inside an escape (after the
  backslash, or with ``\\u``'s hex digits to come) or a multi-byte UTF-8 character (the bytes to
  come and the range of the next one): strings hold well-formed UTF-8 only;
- ``(NUM, integer, phase, digits)``: inside a number (phases below);
- ``(LIT, texts, pos)``: ``pos`` bytes into one of ``texts``;
- ``(KEY, node, candidates, pos)``: ``pos`` bytes into one of an object's property names, each
  ``candidates`` entry an index into the node's properties;
- ``(OBJ, node, phase, index, ws)`` and ``(ARR, node, phase, count, ws)``: between the parts of an
  object or array;
- ``(END,)``: the bottom of every stack; the output is complete when only it is left.

States are immutable and hashable, so masks computed for a state can be kept for the next time
the same state comes back (``services/executor/guided.py`` does).

Whitespace: at most ``MAX_WS`` bytes in a row between tokens (none before the end), so that a model
cannot fill its budget with blanks; numbers: at most ``MAX_DIGITS`` digits per part.
"""

from __future__ import annotations

import json
from typing import Any

from .schema import ANY, ARRAY, CHOICE, LITERALS, NUMBER, OBJECT, STRING, UNION, SchemaCompiler

VALUE, STR, NUM, LIT, KEY, OBJ, ARR, END = range(8)
MAX_WS = 32
# Alternatives a state keeps open (a union's members the bytes so far cannot tell apart; nested in
# a recursive schema, they multiply): past this, the first are kept, a narrower guide whose outputs
# are still valid, and the cost of a mask stays bounded.
MAX_STACKS = 64
MAX_DIGITS = 20
_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
# A string frame's mode: after a backslash; in a \u escape: its first hex digit, its second after
# a 'd', hex digits left (_HEX_LEFT + how many), a high surrogate's digits left (_HIGH_LEFT + how
# many), then the low one's backslash, 'u', 'd' and second digit; inside a UTF-8 character (_UTF8 +
# 10 * continuation bytes left + the next one's range).
_ESCAPE, _HEX_LEFT, _U_FIRST, _U_SECOND_D, _HIGH_LEFT = 1, 10, 20, 21, 30
_NEED_BACKSLASH, _NEED_U, _LOW_FIRST, _LOW_SECOND = 40, 41, 42, 43
_UTF8 = 100
_CONTINUATIONS = [(0x80, 0xBF), (0xA0, 0xBF), (0x80, 0x9F), (0x90, 0xBF), (0x80, 0x8F)]
# Lead bytes: continuation bytes to come * 10 + the first one's range (no overlong forms, no
# surrogates, nothing past U+10FFFF).
_LEADS = {**{b: 10 for b in range(0xC2, 0xE0)}, 0xE0: 21, **{b: 20 for b in range(0xE1, 0xF0)}, 0xED: 22,
          0xF0: 33, 0xF1: 30, 0xF2: 30, 0xF3: 30, 0xF4: 34}

# Number phases: after '-'; after a leading 0; in the integer's digits; after '.'; in the
# fraction's digits; after 'e'; after the exponent's sign; in the exponent's digits.
N_SIGN, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP = range(8)
_NUM_CAN_END = frozenset({N_ZERO, N_INT, N_FRAC, N_EXP})

# Object phases: after '{'; after a key; after a value; after ','. Array phases: after '['; after a
# value; after ','.
O_OPEN, O_KEY, O_VALUE, O_COMMA = range(4)
A_OPEN, A_VALUE, A_COMMA = range(3)

State = tuple  # a tuple of stacks


def utf8_suffix_start(data: bytes) -> int:
    """The first position from which ``data`` is well-formed UTF-8 (as a string frame takes it: its
    last character may be cut short), ``len(data)`` if none: a run of bytes is allowed inside a
    string from any character boundary at or after it."""
    start, left, low, high = 0, 0, 0, 0
    for pos, byte in enumerate(data):
        if left:
            if low <= byte <= high:
                left, low, high = left - 1, 0x80, 0xBF
                continue
            start, left = pos, 0  # broken here: start again at this byte
        lead = _LEADS.get(byte)
        if byte < 0x80:
            continue
        if lead is None:
            start = pos + 1
            continue
        left, (low, high) = lead // 10, _CONTINUATIONS[lead % 10]
    return start


def compile_guide(spec: Any) -> "Guide":
    """A ``Guide`` for a spec: ``{"json_object": true}`` (any JSON object), ``{"json_schema": S}``
    (a value valid against the JSON schema S) or ``{"choice": [texts]}`` (exactly one of them);
    ``"whitespace": false`` beside a JSON guide writes it compact (no blank between tokens).
    Raises ``ValueError`` saying what is wrong or not supported."""
    if isinstance(spec, (str, bytes)):
        spec = json.loads(spec)
    if not isinstance(spec, dict):
        raise ValueError("a guide is one of json_object, json_schema or choice")
    spec = dict(spec)
    whitespace = spec.pop("whitespace", True)
    if not isinstance(whitespace, bool):
        raise ValueError(f"whitespace must be true or false, got {whitespace!r}")
    if len(spec) != 1:
        raise ValueError("a guide is one of json_object, json_schema or choice")
    (kind, value), = spec.items()
    if kind == "json_object":
        compiler = SchemaCompiler(None)
        root = compiler.free_object(compiler.any())
    elif kind == "json_schema":
        compiler = SchemaCompiler(value)
        root = compiler.compile(value)
    elif kind == "choice":
        compiler = SchemaCompiler(None)
        root = compiler.choice(value)
    else:
        raise ValueError(f"unknown guide {kind!r}: one of json_object, json_schema or choice")
    return Guide(compiler.nodes, root, MAX_WS if whitespace else 0)


class Guide:
    """The automaton for one compiled spec. ``initial()`` is the state before any output;
    ``advance(state, byte)`` the state after one more byte, or None when the byte is not allowed."""

    def __init__(self, nodes: list[tuple], root: int, max_ws: int = MAX_WS) -> None:
        self.max_ws = max_ws  # whitespace bytes in a row
        self.nodes = [*nodes, (STRING, 0, -1)]  # the last: an object's free keys
        self._free_key = len(self.nodes) - 1
        self.root = root
        self._initial = self._settle(((END,), (VALUE, root, 0)))[:MAX_STACKS]

    def initial(self) -> State:
        return self._initial

    def advance(self, state: State, byte: int) -> State | None:
        out: dict[tuple, None] = {}
        for stack in state:
            for new in self._step(stack, byte):
                out[new] = None
        if len(out) > MAX_STACKS:  # keep the first: a narrower guide, every output still valid
            return tuple(out)[:MAX_STACKS]
        return tuple(out) if out else None

    def advance_bytes(self, state: State | None, data: bytes) -> State | None:
        for byte in data:
            if state is None:
                return None
            state = self.advance(state, byte)
        return state

    def is_complete(self, state: State) -> bool:
        """Whether the output may end here (the spec's value is whole)."""
        return any(self._can_end(stack) for stack in state)

    def can_continue(self, state: State) -> bool:
        """Whether any byte may follow (false once a value that cannot grow is complete)."""
        return any(stack[-1][0] != END for stack in state)

    def free_string_budget(self, state: State) -> float | None:
        """When every stack is inside a string, not in an escape: how many more characters may
        follow without ending it (``inf`` when unbounded); else None. A run of bytes that are
        neither '"', '\\' nor control bytes is then allowed as long as it is within the budget."""
        best = -1.0
        for stack in state:
            top = stack[-1]
            if top[0] != STR or top[3]:
                return None
            node = self.nodes[top[1]]
            high = node[2] if node[0] == STRING else -1
            best = max(best, float("inf") if high < 0 else high - top[2])
        return best

    def bounded_string(self, state: State) -> tuple[State, int, int, int] | None:
        """For a state inside one string with length bounds, between characters: the same state
        in a string without bounds, the characters written so far, and the bounds (min, max; max
        -1: none); else None. A token then fits the bounded string when it fits the unbounded one
        and the characters it writes before closing it keep within the bounds, so the unbounded
        state's mask, which comes back at every position, serves every position (``guided.py``)."""
        if len(state) != 1:
            return None
        stack = state[0]
        top = stack[-1]
        if top[0] != STR or top[3]:
            return None
        node = self.nodes[top[1]]
        if node[0] != STRING or (node[1] <= 0 and node[2] < 0):
            return None
        return (stack[:-1] + ((STR, self._free_key, 0, 0),),), top[2], node[1], node[2]

    # ---------------------------------------------------------------- one byte on one stack

    def _settle(self, stack: tuple) -> tuple[tuple, ...]:
        """Expand unions at the top into one stack per member (a state never has a union on top)."""
        top = stack[-1]
        if top[0] == VALUE and self.nodes[top[1]][0] == UNION:
            out: list[tuple] = []
            for member in self.nodes[top[1]][1]:
                out.extend(self._settle(stack[:-1] + ((VALUE, member, top[2]),)))
            return tuple(out)
        return (stack,)

    def _step(self, stack: tuple, byte: int) -> tuple[tuple, ...]:
        top = stack[-1]
        kind = top[0]
        if kind == STR:
            return self._string(stack, top, byte)
        if kind == VALUE:
            return self._value(stack, top, byte)
        if kind == NUM:
            return self._number(stack, top, byte)
        if kind == LIT or kind == KEY:
            return self._literal(stack, byte)
        if kind == OBJ:
            return self._object(stack, top, byte)
        if kind == ARR:
            return self._array(stack, top, byte)
        return ()  # END: nothing follows

    def _done(self, stack: tuple) -> tuple[tuple, ...]:
        """The top frame is complete: pop it and tell its parent."""
        stack = stack[:-1]
        parent = stack[-1]
        kind = parent[0]
        if kind == OBJ:
            # A key done (OBJ's phase says which: O_OPEN/O_COMMA -> the key; O_KEY -> its value).
            if parent[2] == O_KEY:
                return (stack[:-1] + ((OBJ, parent[1], O_VALUE, parent[3], 0),),)
            raise AssertionError("an object's key is finished by _key_done")
        if kind == ARR:
            return (stack[:-1] + ((ARR, parent[1], A_VALUE, self._count(parent[1], parent[3] + 1), 0),),)
        return (stack,)  # END

    def _value(self, stack: tuple, top: tuple, byte: int) -> tuple[tuple, ...]:
        node = self.nodes[top[1]]
        kind = node[0]
        if byte in _WS and kind != CHOICE:  # a choice is raw text, written as it is
            if top[2] >= self.max_ws:
                return ()
            return (stack[:-1] + ((VALUE, top[1], top[2] + 1),),)
        base = stack[:-1]
        if kind == ANY:
            if byte == 0x7B:  # {
                return self._open_object(base, top[1])
            if byte == 0x5B:  # [
                return self._open_array(base, top[1])
            if byte == 0x22:  # "
                return (base + ((STR, top[1], 0, 0),),)
            if byte == 0x2D or byte in _DIGITS:
                return self._number_start(base, False, byte)
            return self._literal(base + ((LIT, (b"true", b"false", b"null"), 0),), byte)
        if kind == OBJECT:
            return self._open_object(base, top[1]) if byte == 0x7B else ()
        if kind == ARRAY:
            return self._open_array(base, top[1]) if byte == 0x5B else ()
        if kind == STRING:
            if byte != 0x22:
                return ()
            return (base + ((STR, top[1], 0, 0),),)
        if kind == NUMBER:
            return self._number_start(base, node[1], byte) if byte == 0x2D or byte in _DIGITS else ()
        if kind == LITERALS or kind == CHOICE:
            return self._literal(base + ((LIT, node[1], 0),), byte)
        raise AssertionError(f"node kind {kind} at a value's start")

    # strings

    def _string(self, stack: tuple, top: tuple, byte: int) -> tuple[tuple, ...]:
        node_id, chars, mode = top[1], top[2], top[3]
        node = self.nodes[node_id]
        if mode:
            if mode >= _UTF8:  # inside a multi-byte character: a continuation byte in its range
                left, kind = divmod(mode - _UTF8, 10)
                low, high = _CONTINUATIONS[kind]
                if not low <= byte <= high:
                    return ()
                return (stack[:-1] + ((STR, node_id, chars, _UTF8 + 10 * (left - 1) if left > 1 else 0),),)
            if mode != _ESCAPE:  # inside a \u escape
                mode = self._unicode_escape(mode, byte)
                return () if mode is None else (stack[:-1] + ((STR, node_id, chars, mode),),)
            if byte == 0x75:  # after a backslash: u, or one of the one-letter escapes
                return (stack[:-1] + ((STR, node_id, chars, _U_FIRST),),)
            return (stack[:-1] + ((STR, node_id, chars, 0),),) if byte in _ESCAPES else ()
        bounded = node[0] == STRING and (node[1] > 0 or node[2] >= 0)
        if byte == 0x22:  # the closing quote
            if bounded and chars < node[1]:
                return ()
            return self._string_done(stack)
        if byte < 0x20:
            return ()
        if byte < 0x80:
            mode = _ESCAPE if byte == 0x5C else 0
        else:
            lead = _LEADS.get(byte)
            if lead is None:  # a continuation byte with no lead, or a byte UTF-8 never has
                return ()
            mode = _UTF8 + lead
        if bounded:
            if node[2] >= 0 and chars >= node[2]:
                return ()
            chars += 1
        return (stack[:-1] + ((STR, node_id, chars, mode),),)

    @staticmethod
    def _unicode_escape(mode: int, byte: int) -> int | None:
        """The string's mode after one more byte of a ``\\uXXXX`` escape, None if it cannot come:
        a high surrogate (D800-DBFF) must be followed by ``\\u`` and a low one (DC00-DFFF), and a
        low one cannot stand alone, so that the escapes always spell characters."""
        if mode == _NEED_BACKSLASH:
            return _NEED_U if byte == 0x5C else None
        if mode == _NEED_U:
            return _LOW_FIRST if byte == 0x75 else None
        if byte not in _HEX:
            return None
        if mode == _U_FIRST:
            return _U_SECOND_D if byte in b"dD" else _HEX_LEFT + 3
        if mode == _U_SECOND_D:
            if byte in b"01234567":
                return _HEX_LEFT + 2
            return _HIGH_LEFT + 2 if byte in b"89abAB" else None
        if mode == _LOW_FIRST:
            return _LOW_SECOND if byte in b"dD" else None
        if mode == _LOW_SECOND:
            return _HEX_LEFT + 2 if byte in b"cdefCDEF" else None
        if _HIGH_LEFT < mode <= _HIGH_LEFT + 2:
            return mode - 1 if mode > _HIGH_LEFT + 1 else _NEED_BACKSLASH
        return mode - 1 if mode > _HEX_LEFT + 1 else 0  # _HEX_LEFT + digits still to come

    def _string_done(self, stack: tuple) -> tuple[tuple, ...]:
        parent = stack[-2]
        if parent[0] == OBJ and parent[2] in (O_OPEN, O_COMMA):  # a free key: its ':' comes next
            return (stack[:-2] + ((OBJ, parent[1], O_KEY, parent[3], 0),),)
        return self._done(stack)

    # numbers

    def _number_start(self, base: tuple, integer: bool, byte: int) -> tuple[tuple, ...]:
        if byte == 0x2D:
            return (base + ((NUM, integer, N_SIGN, 0),),)
        return (base + ((NUM, integer, N_ZERO if byte == 0x30 else N_INT, 1),),)

    def _number(self, stack: tuple, top: tuple, byte: int) -> tuple[tuple, ...]:
        integer, phase, digits = top[1], top[2], top[3]
        base = stack[:-1]
        digit = byte in _DIGITS
        new = None
        if phase == N_SIGN:
            if digit:
                new = (NUM, integer, N_ZERO if byte == 0x30 else N_INT, 1)
        elif digit and phase in (N_INT, N_FRAC, N_EXP):
            if digits < (4 if phase == N_EXP else MAX_DIGITS):
                new = (NUM, integer, phase, digits + 1)
        elif digit and phase in (N_DOT, N_E, N_ESIGN):
            new = (NUM, integer, N_FRAC if phase == N_DOT else N_EXP, 1)
        elif byte == 0x2E and phase in (N_ZERO, N_INT) and not integer:
            new = (NUM, integer, N_DOT, 0)
        elif byte in (0x65, 0x45) and phase in (N_ZERO, N_INT, N_FRAC) and not integer:
            new = (NUM, integer, N_E, 0)
        elif byte in (0x2B, 0x2D) and phase == N_E:
            new = (NUM, integer, N_ESIGN, 0)
        if new is not None:
            return (base + (new,),)
        if phase in _NUM_CAN_END:  # the number ends before this byte, which its parent reads
            return self._ended_before(stack, byte)
        return ()

    # literals and keys

    def _literal(self, stack: tuple, byte: int) -> tuple[tuple, ...]:
        top = stack[-1]
        texts, pos = (top[2], top[3]) if top[0] == KEY else (top[1], top[2])
        if top[0] == KEY:
            props = self.nodes[top[1]][1]
            going = tuple(j for j in texts if len(props[j][0]) > pos and props[j][0][pos] == byte)
            if not going:
                return ()
            done = [j for j in going if len(props[j][0]) == pos + 1]
            if done:  # keys are distinct and end with '"': one is complete, and nothing else goes on
                parent = stack[-2]
                return (stack[:-2] + ((OBJ, parent[1], O_KEY, done[0], 0),),)
            return (stack[:-1] + ((KEY, top[1], going, pos + 1),),)
        going = tuple(t for t in texts if len(t) > pos and t[pos] == byte)
        if going:
            if all(len(t) == pos + 1 for t in going):
                return self._done(stack)
            return (stack[:-1] + ((LIT, going, pos + 1),),)
        if any(len(t) == pos for t in texts):  # a shorter text is complete: it ends before this byte
            return self._ended_before(stack, byte)
        return ()

    def _ended_before(self, stack: tuple, byte: int) -> tuple[tuple, ...]:
        """The top frame (a number or literal that may end where it is) ends before ``byte``, which
        its parent then reads."""
        out: list[tuple] = []
        for popped in self._done(stack):
            out.extend(self._step(popped, byte))
        return tuple(out)

    # objects

    def _open_object(self, base: tuple, node_id: int) -> tuple[tuple, ...]:
        return (base + ((OBJ, node_id, O_OPEN, 0, 0),),)

    def _next_keys(self, node: tuple, index: int) -> tuple[tuple[int, ...], bool]:
        """The properties that may come next after ``index`` of them have been passed, and whether
        the object may close (no required property is left)."""
        props = node[1]
        keys = []
        for j in range(index, len(props)):
            keys.append(j)
            if props[j][2]:
                return tuple(keys), False
        return tuple(keys), True

    def _object(self, stack: tuple, top: tuple, byte: int) -> tuple[tuple, ...]:
        node_id, phase, index, ws = top[1], top[2], top[3], top[4]
        node = self.nodes[node_id]
        free = node[0] == ANY or node[2] is not None
        base = stack[:-1]
        if byte in _WS:
            return (base + ((OBJ, node_id, phase, index, ws + 1),),) if ws < self.max_ws else ()
        if phase == O_KEY:
            if byte != 0x3A:  # :
                return ()
            if free:
                value = node_id if node[0] == ANY else node[2]
            else:
                value = node[1][index][1]
            here = base + ((OBJ, node_id, O_KEY, index if free else index + 1, 0),)
            return self._settle(here + ((VALUE, value, 0),))
        if phase == O_VALUE:
            if byte == 0x2C:  # ,
                if not free and not self._next_keys(node, index)[0]:
                    return ()
                return (base + ((OBJ, node_id, O_COMMA, index, 0),),)
            if byte == 0x7D:  # }
                if not free and not self._next_keys(node, index)[1]:
                    return ()
                return self._done(stack)
            return ()
        # O_OPEN or O_COMMA: a key next (or, just after '{', the end)
        if byte == 0x7D and phase == O_OPEN and (free or self._next_keys(node, index)[1]):
            return self._done(stack)
        if byte != 0x22:
            return ()
        if free:
            return (base + ((OBJ, node_id, phase, index, 0), (STR, self._free_key, 0, 0)),)
        keys, _ = self._next_keys(node, index)
        if not keys:
            return ()
        return (base + ((OBJ, node_id, phase, index, 0), (KEY, node_id, keys, 1)),)

    # arrays

    def _open_array(self, base: tuple, node_id: int) -> tuple[tuple, ...]:
        return (base + ((ARR, node_id, A_OPEN, 0, 0),),)

    def _count(self, node_id: int, count: int) -> int:
        """An array's item count as its frame keeps it: exact up to its maxItems, else only up to its
        minItems (so that the states of long unbounded arrays repeat, and their masks are reused)."""
        node = self.nodes[node_id]
        if node[0] != ARRAY or node[3] >= 0:
            return count if node[0] == ARRAY else 0
        return min(count, node[2])

    def _array(self, stack: tuple, top: tuple, byte: int) -> tuple[tuple, ...]:
        node_id, phase, count, ws = top[1], top[2], top[3], top[4]
        node = self.nodes[node_id]
        low, high, item = (0, -1, node_id) if node[0] == ANY else (node[2], node[3], node[1])
        base = stack[:-1]
        if byte in _WS:
            return (base + ((ARR, node_id, phase, count, ws + 1),),) if ws < self.max_ws else ()
        if byte == 0x5D:  # ]
            if phase == A_COMMA or count < low:
                return ()
            return self._done(stack)
        if phase == A_VALUE:
            if byte != 0x2C or (high >= 0 and count >= high):
                return ()
            return (base + ((ARR, node_id, A_COMMA, count, 0),),)
        if high == 0:
            return ()
        out: list[tuple] = []
        for started in self._settle(base + ((ARR, node_id, phase, count, 0), (VALUE, item, 0))):
            out.extend(self._step(started, byte))
        return tuple(out)

    # ---------------------------------------------------------------- the end

    def _can_end(self, stack: tuple) -> bool:
        """Whether this stack is complete, or becomes so by closing a number or literal that may
        end where it is."""
        while True:
            top = stack[-1]
            if top[0] == END:
                return True
            if top[0] == NUM and top[2] in _NUM_CAN_END:
                pass
            elif top[0] == LIT and any(len(t) == top[2] for t in top[1]):
                pass
            else:
                return False
            popped = self._done(stack)
            if len(popped) != 1:
                return False
            stack = popped[0]
