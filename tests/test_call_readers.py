"""The call readers (gateway/call_readers.py) read the same calls however the text is cut
into pieces: each character once, a call opened only when its head is whole."""

from __future__ import annotations

import random

import pytest

from gateway.call_readers import CallArrayReader, CallBlockReader, ReadCall
from gateway.tool_calls import CLOSE_TAG, OPEN_TAG

NAMES = frozenset({"add", "note"})
ARRAY = ('[{"name": "add", "arguments": {"a": 1, "s": "x}\\"]"}}, '
         '{"name":"note","arguments":{"t":[1,{"u":"]"}]}} ,{"name": "add", "arguments": 5}, '
         '{"name": "note", "arguments": "str"}]')
BLOCKS = ('Sure. <tool_call>{"name": "add", "arguments": {"a": "</tool_call>"}}</tool_call>\n'
          'and <tool_call>\n{"name": "note", "arguments": {}}\n</tool_call> done')


def _read(reader: CallArrayReader | CallBlockReader, text: str, cuts: list[int]
          ) -> list[ReadCall]:
    calls: list[ReadCall] = []
    for cut in [*cuts, len(text)]:
        calls = reader.feed(text[:cut])
    return calls


@pytest.mark.parametrize("seed", range(50))
def test_any_split_reads_the_same_calls(seed: int) -> None:
    rng = random.Random(seed)
    array = _read(CallArrayReader(NAMES), ARRAY, sorted(rng.sample(range(len(ARRAY)), 25)))
    assert [(c.name, c.arguments(ARRAY)) for c in array] == [
        ("add", '{"a": 1, "s": "x}\\"]"}'), ("note", '{"t":[1,{"u":"]"}]}'), ("add", "5"),
        ("note", '"str"')]
    block_reader = CallBlockReader(NAMES, OPEN_TAG, CLOSE_TAG)
    blocks = _read(block_reader, BLOCKS, sorted(rng.sample(range(len(BLOCKS)), 25)))
    assert [(c.name, c.arguments(BLOCKS)) for c in blocks] == [
        ("add", '{"a": "</tool_call>"}'), ("note", "{}")]
    assert block_reader.outside(BLOCKS) == ("Sure. ", "\nand  done")


def test_a_call_opens_only_once_its_arguments_begin() -> None:
    reader = CallArrayReader(NAMES)
    assert reader.feed('[{"name": "add", "arguments":') == []
    assert reader.feed('[{"name": "add", "arguments":  ') == []
    [call] = reader.feed('[{"name": "add", "arguments":  {"a"')
    assert call.arguments('[{"name": "add", "arguments":  {"a"') == '{"a"' and call.end is None
    # A function not offered is read past (the grammar allows none), the next one read.
    text = '[{"name": "rm", "arguments": {"x": "}"}}, {"name": "note", "arguments": {}}]'
    assert [c.name for c in CallArrayReader(NAMES).feed(text)] == ["note"]


def test_a_block_cut_short_runs_to_the_end() -> None:
    text = 'Hi <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> x <tool_call>{"na'
    reader = CallBlockReader(NAMES, OPEN_TAG, CLOSE_TAG)
    assert [c.name for c in reader.feed(text)] == ["add"]
    assert reader.outside(text) == ("Hi ", " x ")
