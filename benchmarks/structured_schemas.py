"""The structured-outputs benchmark's workload: its eight JSON schemas, the chat prompts that
ask for them, and the jobs (prompt and constrained sampling params) built from them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput

SYSTEM_PROMPT = ("You are a careful assistant that answers with a single JSON object and "
                 "nothing else.")


@dataclass(frozen=True)
class SchemaCase:
    """One JSON schema and the user requests that ask for an object of it."""

    name: str
    schema: dict[str, Any]
    requests: tuple[str, ...]

    @property
    def structured(self) -> StructuredOutput:
        return StructuredOutput("json", json.dumps(self.schema))


def _obj(properties: dict[str, Any], optional: Sequence[str] = ()) -> dict[str, Any]:
    """A closed object schema: every property required unless named in ``optional``, no
    other property allowed (what OpenAI's strict mode asks of a schema)."""
    return {"type": "object", "properties": properties,
            "required": [p for p in properties if p not in optional],
            "additionalProperties": False}


def _str(max_length: int, min_length: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def _pattern(regex: str) -> dict[str, Any]:
    return {"type": "string", "pattern": regex}


def _int(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def _num(low: float, high: float) -> dict[str, Any]:
    return {"type": "number", "minimum": low, "maximum": high}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def _list(items: dict[str, Any], max_items: int, min_items: int = 1) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


EMAIL = r"^[a-z0-9._]{1,24}@[a-z0-9-]{1,16}\.[a-z]{2,4}$"
BOOLEAN = {"type": "boolean"}


def schema_cases() -> tuple[SchemaCase, ...]:
    """The eight schemas of the benchmark and their prompts."""
    return (
        SchemaCase("person", _obj({
            "name": _str(40), "age": _int(0, 120), "occupation": _str(40),
            "languages": _list(_str(20), 4), "email": _pattern(EMAIL)}, optional=("email",)),
            ("Extract the person described here: 'Maria Lopez, 34, works as a nurse in "
             "Seville. She speaks Spanish, English and a little French. Write to her at "
             "maria.lopez@example.com.'",
             "Extract the person described here: 'Kenji Sato is a 52-year-old architect "
             "from Osaka who speaks Japanese and German.'")),
        SchemaCase("address", _obj({
            "street": _str(60), "city": _str(40), "postal_code": _pattern(r"^[0-9]{5}$"),
            "country": _enum("France", "Germany", "Italy", "Spain", "United Kingdom",
                             "United States")}),
            ("What is the postal address of the Louvre museum in Paris?",
             "Write this address as a record: 'Brandenburger Tor, Pariser Platz, 10117 "
             "Berlin, Germany'.")),
        SchemaCase("product", _obj({
            "name": _str(50), "price": _num(0, 10000), "currency": _enum("USD", "EUR", "GBP"),
            "tags": _list(_str(20), 5), "in_stock": BOOLEAN}),
            ("Write a catalogue entry for this product: a stainless steel water bottle, "
             "750 ml, keeps drinks cold for 24 hours, 24.90 euros, available now.",
             "Write a catalogue entry for this product: wireless noise-cancelling "
             "headphones, 30 hours of battery, $199, currently sold out.")),
        SchemaCase("event", _obj({
            "title": _str(60),
            "date": _pattern(r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"),
            "start_time": _pattern(r"^([01][0-9]|2[0-3]):[0-5][0-9]$"),
            "location": _str(60), "expected_attendees": _int(1, 100000)}),
            ("Make a calendar entry for this announcement: 'The Lisbon Python meetup "
             "returns on 14 March 2025 at 18:30 in the Startup Lisboa auditorium; about 80 "
             "people are expected.'",
             "Make a calendar entry: the annual company picnic is on July 5th 2025, starting "
             "at noon in Riverside Park, for roughly 250 employees.")),
        SchemaCase("review", _obj({
            "answer": _enum("yes", "no"), "confidence": _num(0, 1), "reason": _str(100)}),
            ("Is this customer review positive? 'The battery lasts all day and the screen "
             "is gorgeous, but the speakers are a bit quiet.'",
             "Is this customer review positive? 'Arrived broken, and support never answered "
             "my emails. Avoid.'")),
        SchemaCase("order", _obj({
            "order_id": _pattern(r"^ORD-[0-9]{6}$"),
            "customer": _obj({"name": _str(40), "email": _pattern(EMAIL)}),
            "items": _list(_obj({"sku": _pattern(r"^[A-Z]{3}-[0-9]{3}$"),
                                 "quantity": _int(1, 20), "unit_price": _num(0, 1000)}), 3),
            "total": _num(0, 10000)}),
            ("Turn this message into an order record: 'Hi, this is John Smith "
             "(john.smith@mail.com). I would like 2 notebooks (NTB-001, 3.50 each) and one "
             "pen set (PEN-204, 12.00). My order number is ORD-104233.'",
             "Turn this message into an order record: 'Order ORD-550912 for Ana Silva, "
             "ana@silva.pt: three coffee mugs, item MUG-310, 8 euros each.'")),
        SchemaCase("ticket", _obj({
            "category": _enum("billing", "technical", "account", "shipping", "other"),
            "priority": _enum("low", "medium", "high", "urgent"), "summary": _str(120),
            "needs_human": BOOLEAN}),
            ("Triage this support email: 'I was charged twice for my subscription this "
             "month and I need a refund as soon as possible.'",
             "Triage this support email: 'The app crashes every time I open the settings "
             "page on my phone since the last update.'")),
        SchemaCase("recipe", _obj({
            "title": _str(60), "servings": _int(1, 12), "prep_minutes": _int(1, 240),
            "ingredients": _list(_str(30), 6), "vegetarian": BOOLEAN}),
            ("Give me a simple recipe for pancakes.",
             "Give me a quick recipe for a tomato and mozzarella salad.")),
    )


# --------------------------------------------------------------------------- prompts
def render_prompt(tokenizer: PreTrainedTokenizerBase, case: SchemaCase, request: str
                  ) -> list[int]:
    """The token ids of one chat turn asking for ``case``'s JSON. A tokenizer without a
    chat template (the tests' tiny model) gets the same text as plain lines."""
    user = (f"{request}\nReply with a JSON object that follows this JSON schema:\n"
            f"{json.dumps(case.schema)}")
    if tokenizer.chat_template:
        text = str(tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}],
            add_generation_prompt=True, tokenize=False))
    else:
        text = f"{SYSTEM_PROMPT}\nUser: {user}\nAssistant: "
    # The template already holds the special tokens: the tokenizer must not add its own.
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


@dataclass(frozen=True)
class Job:
    """One request of the workload: its schema, prompt and (constrained) sampling params."""

    case: SchemaCase
    request: str
    """The user's words (the prompt is them and the schema under the chat template)."""
    prompt: list[int]
    params: SamplingParams

    @property
    def seed(self) -> int | None:
        return self.params.seed

    def plain(self) -> SamplingParams:
        """The same params without the constraint (the masking cost's baseline)."""
        return replace(self.params, structured=None)


def make_jobs(tokenizer: PreTrainedTokenizerBase, cases: Sequence[SchemaCase], n: int, *,
              max_tokens: int, temperature: float, seed: int) -> list[Job]:
    """``n`` requests, round-robin over ``cases`` (and over each case's prompts on every
    pass), request i seeded with ``seed + i``."""
    prompts = {(c.name, r): render_prompt(tokenizer, c, r) for c in cases for r in c.requests}
    jobs = []
    for i in range(n):
        case = cases[i % len(cases)]
        request = case.requests[(i // len(cases)) % len(case.requests)]
        jobs.append(Job(case, request, prompts[case.name, request], SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed + i,
            structured=case.structured)))
    return jobs
