"""Agent requests against chimera with the official `openai` client: structured outputs, forced
tool calls, tool results in the history, hostile grammars.

Runs against a live server at $CHIMERA_BASE_URL started with `--tool-call-parser hermes`, with
pytest or as a plain script (prints "N passed, M failed"). The checks hold for any model, the
embedded random-weight one included: the constraint plugin makes every constrained answer
follow its schema whatever the weights, so what is checked is the server, not the model.
"""

import json
import os
import time

import openai

BASE_URL = os.environ.get("CHIMERA_BASE_URL", "http://127.0.0.1:8000/v1")
client = openai.OpenAI(base_url=BASE_URL, api_key="unused", max_retries=0, timeout=120)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Ada", "Alan", "Grace"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "admin", "tags"],
    "additionalProperties": False,
}


def model():
    return client.models.list().data[0].id


def check_weather(args):
    a = json.loads(args)
    assert set(a) == {"city", "unit", "days"}, a
    assert a["city"] in ("Paris", "Rome", "Oslo") and a["unit"] in ("celsius", "fahrenheit"), a
    assert isinstance(a["days"], int) and 1 <= a["days"] <= 7, a


def check_person(text):
    p = json.loads(text)
    assert set(p) == {"name", "age", "admin", "tags"}, p
    assert p["name"] in ("Ada", "Alan", "Grace") and isinstance(p["admin"], bool), p
    assert isinstance(p["age"], int) and 0 <= p["age"] <= 120, p
    assert isinstance(p["tags"], list) and len(p["tags"]) <= 3 and set(p["tags"]) <= {"a", "b"}, p


def chat(**kw):
    kw.setdefault("model", model())
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 400)
    return client.chat.completions.create(**kw)


def streamed_calls(**kw):
    """The tool calls of a streamed chat, assembled from OpenAI-shaped deltas."""
    calls, finish = {}, None
    for chunk in chat(stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        for d in c.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                call["id"] = d.id
            if d.function and d.function.name:
                call["name"] = d.function.name
            if d.function and d.function.arguments:
                call["arguments"] += d.function.arguments
        finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_json_schema_answers_parse_and_validate():
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for i in range(20):
        r = chat(
            messages=[{"role": "user", "content": f"Describe person number {i} as JSON."}],
            response_format=rf,
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        check_person(r.choices[0].message.content)


def test_json_object_and_structured_outputs():
    r = chat(messages=[{"role": "user", "content": "Any JSON object."}], response_format={"type": "json_object"})
    # Any object may be longer than max_tokens; one that ended must parse.
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length"), c
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict), c.message.content
    else:
        assert c.message.content.lstrip().startswith("{"), c.message.content
    r = chat(
        messages=[{"role": "user", "content": "Yes or no?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].message.content in ("yes", "no")
    r = chat(
        messages=[{"role": "user", "content": "A date."}],
        extra_body={"structured_outputs": {"regex": "20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"}},
    )
    content = r.choices[0].message.content
    assert len(content) == 10 and content[:2] == "20" and content[4] == "-", content


def test_completions_take_structured_outputs():
    r = client.completions.create(
        model=model(), prompt="The answer is", max_tokens=16, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].text in ("yes", "no"), r.choices[0]


def test_named_and_required_tool_calls_validate_and_stream_the_same():
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        kw = dict(messages=messages, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
        r = chat(**kw)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        assert m.tool_calls, m
        for call in m.tool_calls:
            assert call.type == "function" and call.id
            if call.function.name == "get_weather":
                check_weather(call.function.arguments)
            else:
                assert call.function.name == "get_time", call
                assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
        if choice is named:
            assert [c.function.name for c in m.tool_calls] == ["get_weather"]
        calls, finish = streamed_calls(**kw)
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls
        ]
        assert all(c["id"] for c in calls)


def test_a_tool_result_in_the_history_changes_the_prompt():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}
    base = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    a = chat(messages=base + [{"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}], tools=[WEATHER], tool_choice="none", max_tokens=4)
    b = chat(messages=base + [{"role": "tool", "tool_call_id": "call_1", "content": "heavy rain and wind all day, 9 C"}], tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert a.usage.prompt_tokens != b.usage.prompt_tokens


def test_bad_and_hostile_grammars_are_refused_quickly():
    deep = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    bad = [
        {"extra_body": {"structured_outputs": {"regex": "("}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "https://example.com/x.json"}}}},
        {"extra_body": {"structured_outputs": {"regex": "(a|aa)*" * 300 + "b"}}, "max_tokens": 2},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    ]
    for kw in bad:
        start = time.monotonic()
        try:
            r = chat(messages=[{"role": "user", "content": "x"}], **kw)
            # A grammar that compiles (the regex one may) must still answer within its limits.
            assert r.choices[0].finish_reason in ("stop", "length"), (kw, r)
        except openai.BadRequestError as e:
            assert e.status_code == 400, e
        assert time.monotonic() - start < 2.0, kw
    # And the server still serves.
    assert chat(messages=[{"role": "user", "content": "hi"}], max_tokens=2).choices[0].message.role == "assistant"


if __name__ == "__main__":
    from runner import run_tests

    run_tests(globals())
