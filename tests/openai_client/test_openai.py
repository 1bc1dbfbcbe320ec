"""chimera against the official `openai` Python client: completions, chat, streaming, errors.

Runs against a live server at $CHIMERA_BASE_URL (default http://127.0.0.1:8000/v1), with
pytest or as a plain script (`python3 test_openai.py`, which prints "N passed, M failed").
Outputs are compared between streamed and non-streamed calls at temperature 0, so the checks
hold for any model, the embedded random-weight one included.
"""

import os

import openai

BASE_URL = os.environ.get("CHIMERA_BASE_URL", "http://127.0.0.1:8000/v1")
client = openai.OpenAI(base_url=BASE_URL, api_key="unused", max_retries=0, timeout=60)


def model():
    models = client.models.list().data
    assert models, "the server lists no model"
    return models[0].id


def test_models():
    m = client.models.list().data
    assert len(m) >= 1 and m[0].object == "model" and m[0].id


def test_completion():
    r = client.completions.create(model=model(), prompt="hello world", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert isinstance(r.choices[0].text, str)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_matches():
    kw = dict(model=model(), prompt="the cat sat", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_completion_n_and_token_prompt():
    r = client.completions.create(model=model(), prompt=[[1, 2, 3], [4, 5]], max_tokens=4, n=2, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5


def test_chat():
    r = client.chat.completions.create(
        model=model(), messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.usage.prompt_tokens > 0


def test_chat_stream_with_usage():
    kw = dict(model=model(), messages=[{"role": "user", "content": "the dog"}], max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_logprobs():
    r = client.chat.completions.create(
        model=model(), messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_echo_with_prompt_logprobs():
    prompt = "the cat sat on the mat"
    r = client.completions.create(model=model(), prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
    # Every prompt token but the first is scored by the model.
    assert lp.token_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0.0 for x in lp.token_logprobs[1:])
    assert all(top and len(top) <= 2 for top in lp.top_logprobs[1:])


def test_stop_string():
    kw = dict(model=model(), prompt="a dog ran", max_tokens=32, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    if len(text) < 6:
        return  # too short to pick a stop string from; nothing to check
    stop = text[3:6]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_errors():
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404
    try:
        client.completions.create(model=model(), prompt="x", max_tokens=2, temperature=9)
        raise AssertionError("temperature 9 accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400
        assert e.body["code"] == "invalid_request"


if __name__ == "__main__":
    from runner import run_tests

    run_tests(globals())
