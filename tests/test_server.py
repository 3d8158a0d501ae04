"""The OpenAI-compatible server, live on loopback, driven by the official openai client."""

import asyncio
import gzip
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from conftest import add_word_tokenizer, make_drafter, make_target
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from blockspec import LLM, SamplingParams
from blockspec.bench import report, serve_load
from blockspec.cli import main
from blockspec.engine.detokenizer import append_text
from blockspec.engine.sequence import Sequence
from blockspec.outputs import RequestMetrics, RequestOutput, TokenLogprob
from blockspec.server.api import build_app
from blockspec.server.async_engine import NewestOutput
from blockspec.server.http import HeadTimeoutProtocol
from blockspec.server.metrics import ServerMetrics
from blockspec.server.protocol import ChatMessage
from blockspec.server.serving import ChatFormat, OpenAIServing, vocab_bytes
from blockspec.structured_output import StructuredOutput

KEY = "test-key"
NAME = "tiny"
MAX_MODEL_LEN = 256


@dataclass
class Live:
    url: str
    reference: LLM  # a second engine on the same checkpoints, for expected outputs
    served: LLM

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {
            s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve")
    target = make_target(root / "target", "llama")
    add_word_tokenizer(target, 128)
    return target, make_drafter(root / "drafter", target)


def load(checkpoints: tuple[Path, Path]) -> LLM:
    """Fixed block width: the per-request spec_decoding statistics compared below then do not
    depend on step timing (adaptive width changes them, never the text)."""
    target, drafter = checkpoints
    spec = {"model": str(drafter), "adaptive_width": False}
    return LLM(str(target), spec, "cpu", "float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32)


def serve(llm: LLM):
    """The server on `llm`, on a free loopback port: yields its URL."""
    return serve_app(build_app(llm, NAME, KEY))


@contextmanager
def serve_app(app, http: type = HeadTimeoutProtocol) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound before uvicorn starts: no race for the port
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=http))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join()


@pytest.fixture(scope="module")
def live(checkpoints) -> Iterator[Live]:
    served = load(checkpoints)
    with serve(served) as url:
        yield Live(url, load(checkpoints), served)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def test_models(live: Live) -> None:
    assert [m.id for m in live.client().models.list().data] == [NAME]


def test_completion_matches_engine(live: Live) -> None:
    r = live.client().completions.create(model=NAME, prompt="w7 w8 w9", max_tokens=20, temperature=0)
    expected = live.reference.generate("w7 w8 w9", greedy(20))[0]
    assert r.choices[0].text == expected.outputs[0].text
    assert r.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == len(expected.outputs[0].token_ids)
    spec = r.spec_decoding
    lengths = expected.metrics.acceptance_lengths
    assert spec["acceptance_lengths"] == lengths and spec["num_steps"] == len(lengths)
    assert spec["num_accepted_tokens"] == sum(lengths) - len(lengths)
    assert spec["mean_acceptance_length"] == pytest.approx(sum(lengths) / len(lengths))
    assert sum(lengths) == r.usage.completion_tokens


def test_penalties_match_engine(live: Live) -> None:
    """presence_penalty and frequency_penalty (OpenAI's) and repetition_penalty (vLLM's) reach the
    engine: the text is the engine's under the same penalties."""
    r = live.client().completions.create(
        model=NAME, prompt="w7 w8 w9", max_tokens=20, temperature=0, presence_penalty=0.5, frequency_penalty=0.4,
        extra_body={"repetition_penalty": 1.3},
    )  # fmt: skip
    params = SamplingParams(
        temperature=0, max_tokens=20, presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3
    )
    assert r.choices[0].text == live.reference.generate("w7 w8 w9", params)[0].outputs[0].text


def test_guided_decoding_matches_engine(live: Live, monkeypatch) -> None:
    """vLLM's guided_regex and guided_choice (over the word tokenizer's tokens, which the grammar
    sees joined: "w7w8") give the engine's output under the same grammar; the server compiles each
    grammar off the engine's thread."""
    engine, threads = live.served.engine, []
    compile_grammar = engine.compile_grammar
    monkeypatch.setattr(
        engine, "compile_grammar", lambda spec: threads.append(threading.current_thread().name) or compile_grammar(spec)
    )
    cases = {"guided_regex": ("(w[3-9])+", "regex"), "guided_choice": (["w7w8", "w9"], "choice")}
    for field, (value, name) in cases.items():
        r = live.client().completions.create(
            model=NAME, prompt="w7 w8 w9", max_tokens=6, temperature=0, extra_body={field: value}
        )
        params = SamplingParams(temperature=0, max_tokens=6, structured_output=StructuredOutput(**{name: value}))
        expected = live.reference.generate("w7 w8 w9", params)[0].outputs[0]
        assert r.choices[0].text == expected.text and r.choices[0].finish_reason == expected.finish_reason
        assert all(3 <= t <= 9 for t in expected.token_ids[:-1])  # the grammar's tokens, then eos or more
    assert len(threads) == 2 and "blockspec-engine" not in threads


def test_token_id_prompt(live: Live) -> None:
    r = live.client().completions.create(model=NAME, prompt=[7, 8, 9], max_tokens=20, temperature=0)
    assert r.choices[0].text == live.reference.generate([7, 8, 9], greedy(20))[0].outputs[0].text


def test_chat_matches_engine(live: Live) -> None:
    messages = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w30 w31 w32"}]
    r = live.client().chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    expected = live.reference.chat(messages, greedy(24))[0]
    assert r.choices[0].message.content == expected.outputs[0].text
    assert r.spec_decoding["acceptance_lengths"] == expected.metrics.acceptance_lengths


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_equals_non_stream(live: Live, endpoint: str) -> None:
    client = live.client()
    if endpoint == "chat":
        create = client.chat.completions.create
        kwargs = {"messages": [{"role": "user", "content": "w40 w41"}]}
    else:
        create, kwargs = client.completions.create, {"prompt": "w40 w41"}
    kwargs.update(model=NAME, max_tokens=40, temperature=0)
    whole = create(**kwargs)
    chunks = list(create(**kwargs, stream=True, stream_options={"include_usage": True}))
    *content, final, usage_chunk = chunks
    if endpoint == "chat":
        assert content[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in content + [final])
        assert text == whole.choices[0].message.content
    else:
        assert "".join(c.choices[0].text for c in content + [final]) == whole.choices[0].text
    assert len(content) > 1  # it really streamed
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason
    assert final.spec_decoding == whole.spec_decoding
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage


def streamed_text(chunks) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_stream_holds_back_stop_strings(live: Live) -> None:
    client = live.client()
    kwargs = {"model": NAME, "prompt": "w60 w61", "max_tokens": 30, "temperature": 0}
    words = client.completions.create(**kwargs).choices[0].text.split()
    k = len(words) // 2
    stop = f" {words[k]} {words[k + 1]}"  # two tokens: the first streams only if it is not held back
    whole = client.completions.create(**kwargs, stop=[stop])
    assert whole.choices[0].finish_reason == "stop" and stop not in whole.choices[0].text
    assert streamed_text(client.completions.create(**kwargs, stop=[stop], stream=True)) == whole.choices[0].text


def test_seeded_sampling_is_reproducible(live: Live) -> None:
    client = live.client()
    kwargs = {"model": NAME, "prompt": "w70", "max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 7}
    texts = {client.completions.create(**kwargs).choices[0].text for _ in range(2)}
    texts.add(streamed_text(client.completions.create(**kwargs, stream=True)))
    assert len(texts) == 1


def test_concurrent_equals_sequential(live: Live) -> None:
    client = live.client()
    requests = [
        {"prompt": " ".join(f"w{10 + i + j}" for j in range(1 + i % 5)), "max_tokens": 8 + 3 * i} for i in range(16)
    ]

    def run(kwargs: dict) -> tuple[str, int]:
        r = client.completions.create(model=NAME, temperature=0, **kwargs)
        return r.choices[0].text, r.usage.completion_tokens

    sequential = [run(r) for r in requests]
    before = live.metrics()
    with ThreadPoolExecutor(len(requests)) as pool:
        concurrent = list(pool.map(run, requests))
    after = live.metrics()
    assert concurrent == sequential
    # They shared steps: fewer batched engine steps than per-request steps.
    engine_steps = after["blockspec_engine_steps_total"] - before["blockspec_engine_steps_total"]
    assert (
        engine_steps
        < after["blockspec_spec_decode_num_drafts_total"] - before["blockspec_spec_decode_num_drafts_total"]
    )


BAD_COMPLETIONS = [
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"n": 0}, 400, "n"),
    ({"n": 65}, 400, "n"),
    ({"prompt": ["w7"] * 9, "n": 8}, 400, "n"),  # 72 choices
    ({"prompt": []}, 400, "prompt"),
    ({"max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),  # prompt + max_tokens beyond the context
    ({"prompt": " ".join(["w9"] * MAX_MODEL_LEN)}, 400, "max_tokens"),
    ({"prompt": [5, 999]}, 400, "prompt"),  # token id outside the vocabulary
    ({"model": "gpt-4"}, 404, "model"),
    ({"prompt": [True, False]}, 400, "prompt"),  # booleans are no token ids
    ({"logprobs": 21}, 400, "logprobs"),
    ({"best_of": 3}, 400, "best_of"),
    ({"seed": 2**70}, 400, "seed"),
    ({"seed": 2**64 - 1}, 400, "seed"),  # int64 seeds: as unsigned it would alias -1
    (
        {"extra_body": {"stop_token_ids": [-3]}},
        400,
        "stop_token_ids",
    ),  # SamplingParams' own checks name their field too
    ({"extra_body": {"max_token": 5}}, 400, "max_token"),  # unknown fields are named, not ignored
    ({"extra_body": {"min_tokens": 9}}, 400, "min_tokens"),  # more than max_tokens
    ({"extra_body": {"repetition_penalty": 0}}, 400, "repetition_penalty"),  # SamplingParams' range
    ({"presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"extra_body": {"response_format": {"type": "json_object"}}}, 400, "response_format"),  # words make no JSON
    ({"extra_body": {"response_format": {"type": "json_schema"}}}, 400, "response_format"),  # and no schema
    ({"extra_body": {"guided_choice": []}}, 400, "guided_choice"),
    ({"extra_body": {"guided_regex": "w[3-9]", "guided_choice": ["w3"]}}, 400, "guided_choice"),  # one at most
    ({"extra_body": {"guided_json": {"type": "nonsense"}}}, 400, "guided_json"),  # the engine's refusal, named
    ({"extra_body": {"tool_choice": "auto"}}, 400, "tool_choice"),
    ({"prompt": [1, 2], "echo": True, "extra_body": {"skip_special_tokens": "maybe"}}, 400, "skip_special_tokens"),
    ({"extra_body": {"top_k": True}}, 400, "top_k"),  # a boolean is no count (lax pydantic: top_k 1)
    ({"seed": True}, 400, "seed"),
    ({"stop": [""]}, 400, "stop"),
    ({"stop": ["w1"] * 65}, 400, "stop"),
    ({"stop": ["w1" * 513]}, 400, "stop"),  # 1026 characters
]


@pytest.mark.parametrize(("change", "status", "param"), BAD_COMPLETIONS)
def test_bad_completion(live: Live, change: dict, status: int, param: str) -> None:
    kwargs = {"model": NAME, "prompt": "w7", "max_tokens": 4} | change
    with pytest.raises(openai.APIStatusError) as info:
        live.client().completions.create(**kwargs)
    assert info.value.status_code == status
    assert info.value.param == param and info.value.type == "invalid_request_error"


BAD_MESSAGES = [
    [],
    [{"role": "user"}],
    [{"content": "w7"}],
    [{"role": "wizard", "content": "w7"}],
    [{"role": "user", "content": 7}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
    [{"role": "user", "content": None}],  # only an assistant's content may be null (as in tool calls)
    "w7",
]


@pytest.mark.parametrize("messages", BAD_MESSAGES)
def test_bad_messages(live: Live, messages) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        live.client().chat.completions.create(model=NAME, messages=messages)
    assert info.value.param.startswith("messages")


def test_error_shape_and_auth(live: Live) -> None:
    r = httpx.post(f"{live.url}/v1/completions", json={"model": NAME, "prompt": "w7", "top_p": 2}, headers=auth())
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        live.client(key="wrong").models.list()
    assert httpx.get(f"{live.url}/v1/models").status_code == 401  # no key at all
    assert httpx.get(f"{live.url}/health").status_code == 200  # the server is still up


def test_malformed_json_and_union_errors(live: Live) -> None:
    r = httpx.post(f"{live.url}/v1/completions", content=b"{", headers=auth() | {"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert r.json()["error"]["message"].startswith("the request body is not valid JSON")
    r = httpx.post(f"{live.url}/v1/completions", json={"model": NAME, "prompt": 5}, headers=auth())
    assert r.json()["error"]["param"] == "prompt" and r.json()["error"]["message"].startswith("prompt: ")
    off = {"logprobs": None, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "best_of": 1}
    r = httpx.post(
        f"{live.url}/v1/completions", json={"model": NAME, "prompt": "w7", "max_tokens": 3.0} | off, headers=auth()
    )
    assert r.status_code == 200  # off values of unsupported features, as clients send them by default


def test_engine_failure_ends_streams_and_is_counted(checkpoints) -> None:
    """A failing engine step fails the requests in flight with an error event, then [DONE];
    they count as finished with reason "error"; the server serves the next request."""
    llm = load(checkpoints)
    step, calls = llm.engine.step, itertools.count()

    def faulty_step():
        if next(calls) == 3:  # the request's third step
            raise RuntimeError("injected")
        return step()

    llm.engine.step = faulty_step
    body = {"model": NAME, "prompt": "w7", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with serve(llm) as url, httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body, headers=auth()) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["type"] == "server_error"
        assert len(lines) > 3  # tokens came before the failure
        live = Live(url, llm, llm)
        assert live.metrics()["blockspec_requests_total{finish_reason=error}"] == 1
        body = body | {"stream": False, "max_tokens": 3}
        assert client.post(f"{url}/v1/completions", json=body, headers=auth()).status_code == 200


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def wait_for(live: Live, done, what: str) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while not done(m := live.metrics()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return m


def hang_up_mid_stream(live: Live, body: dict) -> None:
    body = body | {"stream": True}
    with httpx.Client() as client, client.stream("POST", f"{live.url}/v1/completions", json=body, headers=auth()) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # one chunk, then hang up


def hang_up_while_waiting(live: Live, body: dict) -> None:
    """A non-streamed request whose client goes away once the engine runs it."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection(tuple(live.url.removeprefix("http://").split(":"))) as sock:
        sock.sendall(head.encode() + payload)
        wait_for(live, lambda m: m["blockspec_requests_running"] == 1, "the request never started")


@pytest.mark.parametrize("hang_up", [hang_up_mid_stream, hang_up_while_waiting])
def test_disconnect_aborts_and_frees_pages(live: Live, hang_up) -> None:
    aborts = "blockspec_requests_total{finish_reason=abort}"
    before = live.metrics().get(aborts, 0)
    hang_up(live, {"model": NAME, "prompt": "w7 w8", "max_tokens": 240, "ignore_eos": True})
    m = wait_for(live, lambda m: m.get(aborts, 0) == before + 1 and not m["blockspec_requests_running"], "no abort")
    assert m["blockspec_kv_pages_free"] == m["blockspec_kv_pages_total"]
    assert m["blockspec_requests_waiting"] == 0
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    r = live.client().completions.create(model=NAME, prompt="w7", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_metrics_agree_with_responses(live: Live) -> None:
    before = live.metrics()
    rs = [
        live.client().completions.create(model=NAME, prompt=f"w{50 + i}", max_tokens=12, temperature=0)
        for i in range(3)
    ]
    after = live.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert (
        delta("blockspec_requests_total{finish_reason=length}") + delta("blockspec_requests_total{finish_reason=stop}")
        == 3
    )
    assert delta("blockspec_prompt_tokens_total") == 3
    assert delta("blockspec_generation_tokens_total") == sum(r.usage.completion_tokens for r in rs)
    assert delta("blockspec_spec_decode_num_drafts_total") == sum(r.spec_decoding["num_steps"] for r in rs)
    assert delta("blockspec_spec_decode_num_draft_tokens_total") == sum(r.spec_decoding["num_draft_tokens"] for r in rs)
    assert delta("blockspec_spec_decode_num_accepted_tokens_total") == sum(
        r.spec_decoding["num_accepted_tokens"] for r in rs
    )
    assert after["blockspec_spec_decode_num_draft_tokens_per_pos_total{position=0}"] > 0
    mean = after["blockspec_generation_tokens_total"] / after["blockspec_spec_decode_num_drafts_total"]
    assert after["blockspec_spec_decode_mean_acceptance_length"] == pytest.approx(mean)


def test_metrics_per_position(checkpoints) -> None:
    """The per-position accounting of one step: 4 drafts verified, 2 accepted, plus the bonus."""
    metrics = ServerMetrics(load(checkpoints).engine)
    step = RequestMetrics(acceptance_lengths=[3], draft_token_ids=[[9, 9, 9, 9]])
    metrics.step(RequestOutput("r", None, [1], [], finished=True, metrics=step))
    value = metrics.registry.get_sample_value
    assert [
        value("blockspec_spec_decode_num_accepted_tokens_per_pos_total", {"position": str(i)}) for i in range(3)
    ] == [1, 1, None]
    assert value("blockspec_spec_decode_num_draft_tokens_per_pos_total", {"position": "3"}) == 1
    assert value("blockspec_spec_decode_num_accepted_tokens_total") == 2
    assert value("blockspec_spec_decode_mean_acceptance_length") == 3


def test_cli_serve_binds_loopback(checkpoints, monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.update(kwargs, app=app))
    target, drafter = checkpoints
    main(
        [
            "serve",
            "--model",
            str(target),
            "--draft",
            str(drafter),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--num-speculative-tokens",
            "3",
        ]
    )
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8000 and seen["http"] is HeadTimeoutProtocol


def completion_texts(live: Live, **kwargs) -> list[str]:
    r = live.client().completions.create(model=NAME, **kwargs)
    assert [c.index for c in r.choices] == list(range(len(r.choices)))
    return [c.text for c in r.choices]


def test_n_choices_greedy_seeded_and_streamed(live: Live) -> None:
    """n greedy choices are the one greedy answer; seeded sampled choices differ from each other,
    choice 0 is the request with n=1, each reproduces, and a stream carries the same choices."""
    assert completion_texts(live, prompt="w7 w8", max_tokens=12, temperature=0, n=3) == 3 * [
        live.reference.generate("w7 w8", greedy(12))[0].outputs[0].text
    ]
    sampled = {"prompt": "w7 w8", "max_tokens": 16, "temperature": 1.0, "seed": 11}
    texts = completion_texts(live, **sampled, n=3)
    assert len(set(texts)) == 3
    assert texts[0] == completion_texts(live, **sampled)[0]
    assert completion_texts(live, **sampled, n=3) == texts
    chunks = live.client().completions.create(model=NAME, **sampled, n=3, stream=True)
    streamed = ["", "", ""]
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts


def test_batched_prompts_and_echo(live: Live) -> None:
    """A batch of prompts: choice p * n + j continues prompt p; usage counts each prompt once;
    echo puts each prompt's text (a token-id prompt's decoded) before its choices' text."""
    r = live.client().completions.create(model=NAME, prompt=["w7 w8", "w9"], n=2, max_tokens=6, temperature=0)
    outs = [live.reference.generate(p, greedy(6))[0].outputs[0] for p in ("w7 w8", "w9")]
    answers = [o.text for o in outs]
    assert [c.text for c in r.choices] == [answers[0], answers[0], answers[1], answers[1]]
    assert r.usage.prompt_tokens == 3
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in outs) * 2
    echoed = completion_texts(live, prompt=[[7, 8], [9]], max_tokens=6, temperature=0, echo=True)
    assert echoed == ["w7 w8" + answers[0], "w9" + answers[1]]
    stream = live.client().completions.create(
        model=NAME, prompt="w9", max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert streamed_text(stream) == "w9" + answers[1]


def test_stop_token_ids_and_include_stop_str(live: Live) -> None:
    """stop_token_ids end the output at the token (its text left out, or kept with
    include_stop_str_in_output); a stop string is kept the same way."""
    out = live.reference.generate("w7 w8", greedy(12))[0]
    tokens, prompt = out.outputs[0].token_ids, out.prompt_token_ids
    stop = tokens[4]
    cut = tokens[: tokens.index(stop) + 1]
    decode = live.reference.tokenizer.decode

    def continuation(ids: list[int]) -> str:  # the text of ids after the prompt's
        return decode(prompt + ids).removeprefix(decode(prompt))

    base = {"prompt": "w7 w8", "max_tokens": 12, "temperature": 0}
    r = live.client().completions.create(model=NAME, **base, extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(cut)
    assert r.choices[0].text == continuation(cut[:-1])
    kept = {"stop_token_ids": [stop], "include_stop_str_in_output": True}
    assert completion_texts(live, **base, extra_body=kept) == [continuation(cut)]
    word = f"w{stop}"
    texts = completion_texts(live, **base, stop=[word], extra_body={"include_stop_str_in_output": True})
    assert texts[0].endswith(word) and texts[0].count(word) == 1


def test_ordinary_chat_formats(live: Live) -> None:
    """Content as text parts (joined by newlines), a developer message (as system), a tool
    message, an assistant's null content, and an end-user id: each renders as its plain form."""
    plain = [{"role": "system", "content": "w20"}, {"role": "user", "content": "w30\nw31"}]
    parts = [
        {"role": "developer", "content": "w20"},
        {"role": "user", "content": [{"type": "text", "text": "w30"}, {"type": "text", "text": "w31"}]},
    ]

    def reply(messages, **extra) -> str:
        r = live.client().chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, **extra)
        return r.choices[0].message.content

    assert reply(parts, user="someone") == reply(plain)
    # the test template reads no roles: the mapping itself, as the template receives it
    developer = ChatMessage(role="developer", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert developer.template_message() == {"role": "system", "content": "a\nb"}
    tool_message = ChatMessage(role="tool", content="w33", tool_call_id="c").template_message()
    assert tool_message == {"role": "tool", "content": "w33", "tool_call_id": "c"}
    named = ChatMessage(role="user", content="w33", name="ann").template_message()
    assert named == {"role": "user", "content": "w33", "name": "ann"}
    tool = [{"role": "assistant", "content": None}, {"role": "tool", "content": "w33", "tool_call_id": "c"}]
    rendered = [{"role": "assistant", "content": ""}, {"role": "tool", "content": "w33"}]
    assert reply(plain + tool) == live.reference.chat(plain + rendered, greedy(8))[0].outputs[0].text


def test_seeds_are_int64_without_aliases(live: Live) -> None:
    sampled = {"prompt": "w7", "max_tokens": 16, "temperature": 1.0}
    assert completion_texts(live, **sampled, seed=-1) != completion_texts(live, **sampled, seed=2**63 - 1)


def post(client: httpx.Client, url: str, body: dict) -> httpx.Response:
    """`body` as JSON with non-ASCII escaped (a lone surrogate as \\ud800, as JSON allows)."""
    headers = auth() | {"content-type": "application/json"}
    return client.post(url, content=json.dumps(body).encode(), headers=headers)


def test_lone_surrogates_are_400s_and_the_connection_serves_on(live: Live) -> None:
    with httpx.Client(timeout=60) as client:
        for path, body, param in [
            ("completions", {"model": NAME, "prompt": "w7 \ud800 w8"}, "prompt"),
            ("completions", {"model": "tiny\udfff", "prompt": "w7"}, "model"),
            ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "w7\ud800"}]}, "messages"),
        ]:
            r = post(client, f"{live.url}/v1/{path}", body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param
            assert "surrogate" in r.json()["error"]["message"]
        r = post(client, f"{live.url}/v1/completions", {"model": NAME, "prompt": "w7", "max_tokens": 2})
        assert r.status_code == 200  # the same keep-alive connection


def test_vague_errors_say_what_is_wrong(live: Live) -> None:
    r = httpx.post(f"{live.url}/v1/completions", headers=auth())
    assert r.status_code == 400 and "request body is empty" in r.json()["error"]["message"]
    r = httpx.post(f"{live.url}/v1/completions", json={"model": NAME, "prompt": "w7", "n": 0}, headers=auth())
    assert r.json()["error"]["param"] == "n" and "greater than or equal to 1" in r.json()["error"]["message"]


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def raw_request(url: str, head: str, body: bytes = b"") -> tuple[bytes, float]:
    """Send a request's head and (part of) its body on a raw socket: the reply's first bytes, and
    the seconds it took."""
    start = time.monotonic()
    with connect(url) as sock:
        sock.sendall(head.encode() + body)
        return sock.recv(4096), time.monotonic() - start


def test_gate_refuses_before_reading_the_body(checkpoints) -> None:
    """A wrong key is a 401 without the body read (a 1 GB declared body never sent); a body
    past the limit a 413, declared or streamed; a body that does not arrive a 408."""
    app = build_app(load(checkpoints), NAME, KEY, max_body_bytes=1000, body_timeout_s=0.5)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with serve_app(app) as url:
        reply, _ = raw_request(url, head + f"Content-Length: {10**9}\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 401")
        reply, _ = raw_request(url, head + f"Authorization: Bearer {KEY}\r\nContent-Length: {10**9}\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 413")
        chunked = head + f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n"
        reply, _ = raw_request(url, chunked, b"7d0\r\n" + b" " * 2000 + b"\r\n0\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 413")
        reply, took = raw_request(url, head + f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n", b"{")
        assert reply.startswith(b"HTTP/1.1 408") and took < 10
        assert httpx.get(f"{url}/health").status_code == 200


class QuickHeadTimeout(HeadTimeoutProtocol):
    head_timeout_s = 0.5


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a content-length (b"" if the server closed instead)."""
    reply = b""
    while b"\r\n\r\n" not in reply:
        if not (more := sock.recv(4096)):
            return reply
        reply += more
    head, _, body = reply.partition(b"\r\n\r\n")
    length = int(
        next(v for k, _, v in (line.partition(b": ") for line in head.split(b"\r\n")) if k.lower() == b"content-length")
    )
    while len(body) < length:
        body += sock.recv(4096)
    return reply


def closed_while_dripping(sock: socket.socket, seconds: float) -> bool:
    """Send a byte every 0.1 s until the server closes the connection (True) or time is up."""
    end = time.monotonic() + seconds
    sock.settimeout(0.5)
    while time.monotonic() < end:
        try:
            sock.sendall(b" ")
            if sock.recv(1, socket.MSG_DONTWAIT) == b"":
                return True
        except (BlockingIOError, TimeoutError):  # nothing to read, or the server reads no more: still open
            pass
        except OSError:  # reset, broken pipe
            return True
        time.sleep(0.1)
    return False


def test_a_slow_request_head_is_a_408(checkpoints) -> None:
    """A client that sends half a head and stalls gets a 408 and a closed connection; one that sends
    nothing is closed; the deadline starts again at the end of each response on a kept-alive
    connection, and for one answered before its body covers the rest of that body (a body that
    drips on is closed); it stops once a head is read (a body arriving after it is served)."""
    with serve_app(build_app(load(checkpoints), NAME, KEY), http=QuickHeadTimeout) as url:
        reply, took = raw_request(url, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in reply and took < 10
        reply, took = raw_request(url, "")
        assert reply == b"" and took < 10
        with connect(url) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200")
            sock.sendall(f"POST /v1/nowhere HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode())
            sock.sendall(b"Content-Length: 4\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 404")  # answered with its body unread
            sock.sendall(b"{}  ")
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 408")
        with connect(url) as sock:  # answered before its body, which then drips and never ends
            sock.sendall(f"POST /v1/nowhere HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode())
            sock.sendall(b"Content-Length: 100\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 404")
            assert closed_while_dripping(sock, seconds=10)
        with connect(url) as sock:
            body = json.dumps({"model": NAME, "prompt": "w7", "max_tokens": 2}).encode()
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode())
            sock.sendall(f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode())
            time.sleep(1.0)
            sock.sendall(body)
            assert read_response(sock).startswith(b"HTTP/1.1 200")
        assert httpx.get(f"{url}/health").status_code == 200


def test_an_answer_before_the_body_closes_the_connection(checkpoints) -> None:
    """A wrong key's 401 comes before the body is read, with the connection closed: the unread body
    is not taken for a request."""
    with serve_app(build_app(load(checkpoints), NAME, KEY)) as url, connect(url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n")
        reply = read_response(sock)
        assert reply.startswith(b"HTTP/1.1 401") and b"connection: close" in reply.lower()
        assert sock.recv(4096) == b""


def test_tokenizing_does_not_block_other_connections(live: Live, monkeypatch) -> None:
    """A prompt being tokenized (made slow here) leaves the event loop free: /health answers."""
    engine = live.served.engine
    tokenize = engine.tokenize
    monkeypatch.setattr(engine, "tokenize", lambda prompt: (time.sleep(2), tokenize(prompt))[1])
    with ThreadPoolExecutor(1) as pool:
        create = live.client().completions.create
        slow = pool.submit(create, model=NAME, prompt="w7 w8", max_tokens=4, temperature=0)
        time.sleep(0.3)
        start = time.monotonic()
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert time.monotonic() - start < 1
        expected = live.reference.generate("w7 w8", greedy(4))[0].outputs[0].text
        assert slow.result().choices[0].text == expected


def test_newest_output_replaces_unread_ones() -> None:
    """A reader that falls behind gets the newest output, not a backlog of every one."""

    async def run() -> list[str]:
        outputs = NewestOutput()
        for i in range(3):
            outputs.put(RequestOutput(str(i), None, [1], [], finished=i == 2, metrics=RequestMetrics()))
        first = await outputs.get()
        return [first.request_id, outputs.item]

    assert asyncio.run(run()) == ["2", None]


def test_cli_serve_refuses_an_address_it_cannot_listen_at_before_loading(tmp_path, capsys) -> None:
    """A port out of range or in use, a host that does not resolve, a byte limit below one: each one
    line, before the model (here none: its error would come first otherwise) loads."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["--port", "99999"], "--port must be in 0..65535, got 99999"),
            (["--port", str(port)], f"cannot listen at 127.0.0.1:{port}"),
            (["--host", "no-such-host.invalid"], "cannot listen at no-such-host.invalid:8000"),
            (["--max-request-bytes", "-1"], "--max-request-bytes must be >= 1, got -1"),
        ]
        for flags, message in cases:
            with pytest.raises(SystemExit):
                main(["serve", "--model", str(tmp_path / "none"), "--device", "cpu", *flags])
            assert message in capsys.readouterr().err


def test_cli_chat_drops_a_turn_past_the_context_and_goes_on(checkpoints, capsys, monkeypatch) -> None:
    lines = iter(["w5 w6", " ".join(["w9"] * 60), "w7"])  # the second outgrows a 64-token context

    def typed(_: str) -> str:
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line

    monkeypatch.setattr("builtins.input", typed)
    flags = ["--device", "cpu", "--max-model-len", "64", "--max-tokens", "4", "--temperature", "0", "--draft", "none"]
    main(["chat", "--model", str(checkpoints[0]), *flags])  # returns at the end of input
    out = capsys.readouterr()
    assert out.err.count("this message was not sent") == 1 and "the context holds 64" in out.err
    assert len(out.out.strip().splitlines()) == 2  # the first and the third turn's replies


def test_cli_serve_refuses_an_empty_api_key(checkpoints, capsys, monkeypatch) -> None:
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("served without a key"))
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(checkpoints[0]), "--device", "cpu", "--api-key", " "])
    assert "the API key is empty" in capsys.readouterr().err


def test_skip_special_tokens_false_keeps_their_text(live: Live) -> None:
    # the text continues the prompt's, bos w1: a space after it where its text is kept
    for skip, text in ((True, "w5 w6"), (False, " w5 w2 w6")):
        seq = Sequence(None, [1], SamplingParams(skip_special_tokens=skip), seed=0)
        seq.token_ids += [5, 2, 6]
        append_text(live.reference.tokenizer, seq, final=True)
        assert seq.text == text


def test_output_text_keeps_its_leading_space_under_a_sentencepiece_decoder() -> None:
    """A SentencePiece decoder (Metaspace) drops the first token's space: the output's first token
    decodes after prompt tokens, so prompt text + output text = the text of both."""
    vocab = {"▁Hello": 0, "▁world": 1, "▁the": 2, "<unk>": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")
    assert tokenizer.decode([1, 2]) == "world the"  # alone: no leading space
    seq = Sequence(None, [0], SamplingParams(), seed=0)
    for token in (1, 2):
        seq.token_ids.append(token)
        append_text(tokenizer, seq)
    assert seq.text == " world the" and tokenizer.decode([0]) + seq.text == "Hello world the"


def test_prefix_cache_hits_are_counted(live: Live) -> None:
    """A prompt twice: the second request holds the first's whole pages of 16 tokens before its
    anchor, and answers the same."""
    before = live.metrics()
    prompt = " ".join(f"w{10 + i}" for i in range(40))
    n = len(live.served.tokenizer.encode(prompt)) - 1
    texts = [completion_texts(live, prompt=prompt, max_tokens=4, temperature=0)[0] for _ in range(2)]
    after = live.metrics()
    assert texts[0] == texts[1]
    assert after["blockspec_prefix_cache_queries_total"] - before["blockspec_prefix_cache_queries_total"] == 2 * n
    assert after["blockspec_prefix_cache_hits_total"] - before["blockspec_prefix_cache_hits_total"] == n // 16 * 16


def test_echo_with_logprobs_carries_the_prompts(live: Live) -> None:
    """A completion echoing its prompt with logprobs: the prompt's tokens first (the first with null
    log-probabilities), then the output's, the engine's values; streamed, the same entries."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    expected = live.reference.generate("w7 w8 w9", sp)[0]
    entries = expected.prompt_logprobs[1:] + expected.outputs[0].logprobs
    request = {"model": NAME, "prompt": "w7 w8 w9", "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True}
    r = live.client().completions.create(**request, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    text = live.served.tokenizer.decode
    assert r.choices[0].text.startswith("w7 w8 w9")
    assert lp.tokens == [text([t]) for t in [expected.prompt_token_ids[0]] + [e.token_id for e in entries]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in entries], abs=1e-5)
    stream = live.client().completions.create(**request, stream=True, extra_body={"ignore_eos": True})
    streamed = [x for chunk in stream for c in chunk.choices if c.logprobs for x in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_logprobs_in_both_shapes_streamed_and_whole(live: Live) -> None:
    """Chat (content entries with top_logprobs) and completions (OpenAI's legacy arrays) carry the
    engine's log-probabilities of every output token; a stream carries the same, chunk by chunk."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    expected = live.reference.generate("w7 w8", sp)[0].outputs[0].logprobs
    text = live.served.tokenizer.decode
    r = live.client().completions.create(
        model=NAME, prompt="w7 w8", max_tokens=8, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == [text([e.token_id]) for e in expected]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected], abs=1e-5)
    assert [list(t) for t in lp.top_logprobs] == [[text([i]) for i in e.top] for e in expected]
    assert lp.text_offset[0] == 0 and len(lp.text_offset) == 8
    messages = [{"role": "user", "content": "w7 w8"}]
    chat = {"model": NAME, "messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = live.client().chat.completions.create(**chat, extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content
    assert len(content) == 8 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= c.top_logprobs[0].logprob + 1e-6 and c.bytes == list(c.token.encode()) for c in content)
    stream = live.client().chat.completions.create(**chat, stream=True, extra_body={"ignore_eos": True})
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    r = httpx.post(f"{live.url}/v1/chat/completions", json=chat | {"logprobs": False}, headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_gate_holds_wherever_the_app_is_mounted(checkpoints) -> None:
    """Behind a proxy prefix (the app mounted under /api) every route but /health and /metrics
    still wants the key."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    outer = FastAPI()
    outer.mount("/api", build_app(load(checkpoints), NAME, KEY))
    client = TestClient(outer)
    assert client.get("/api/v1/models").status_code == 401
    assert client.get("/api/v1/models", headers=auth()).status_code == 200
    assert client.get("/api/metrics").status_code == 200


def test_nulls_mean_defaults_and_deep_json_is_a_400(live: Live) -> None:
    nulls = {"model": NAME, "prompt": "w7", "max_tokens": 2, "n": None, "echo": None, "stream": None}
    r = httpx.post(f"{live.url}/v1/completions", json=nulls, headers=auth())
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    deep = '{"model": "tiny", "messages": ' + "[" * 600 + "]" * 600 + "}"
    r = httpx.post(
        f"{live.url}/v1/chat/completions", content=deep, headers=auth() | {"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    for ids in ([5] * 257, [5, 10**6], [True]):  # too many; outside the vocabulary; no id
        body = {"model": NAME, "prompt": "w7", "max_tokens": 2, "stop_token_ids": ids}
        r = httpx.post(f"{live.url}/v1/completions", json=body, headers=auth())
        assert r.status_code == 400 and "stop_token_ids" in (r.json()["error"]["param"] or r.json()["error"]["message"])
    body = {"model": NAME, "prompt": "w7", "max_tokens": 2, "stop_token_ids": [5.0]}  # JSON's 5.0 is 5, as elsewhere
    assert httpx.post(f"{live.url}/v1/completions", json=body, headers=auth()).status_code == 200


def test_n_choices_share_one_prefill(live: Live) -> None:
    """A request's n choices: the first computes the prompt, the others hold its pages."""
    prompt = " ".join(f"w{60 + i}" for i in range(40))
    n = len(live.served.tokenizer.encode(prompt)) - 1
    before = live.metrics()["blockspec_prefix_cache_hits_total"]
    assert len(set(completion_texts(live, prompt=prompt, max_tokens=4, temperature=0, n=3))) == 1
    assert live.metrics()["blockspec_prefix_cache_hits_total"] - before == 2 * (n // 16 * 16)


def test_load_bench_counts_answers_equal_to_alone(live: Live, tmp_path) -> None:
    """`blockspec.bench.serve_load` against the live server: every request answered, concurrent
    answers (greedy and seeded) equal to the same requests sent one at a time, rows the report
    renders."""
    with gzip.open(tmp_path / "humaneval.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"prompt": f"w{i} w{i + 1}"}) + "\n" for i in range(3))
    (tmp_path / "mtbench.jsonl").write_text("".join(json.dumps({"turns": [f"w{i}", "w2"]}) + "\n" for i in (4, 9)))
    for temperature in ("0", "1"):
        out = tmp_path / f"load-{temperature}.json"
        serve_load.main(
            ["--url", live.url, "--api-key", KEY, "--clients", "4", "--requests", "10", "--max-tokens", "3,9",
             "--temperature", temperature, "--humaneval", str(tmp_path / "humaneval.jsonl.gz"), "--mtbench",
             str(tmp_path / "mtbench.jsonl"), "--out", str(out)]
        )  # fmt: skip
        concurrent, alone = json.loads(out.read_text())["results"]
        assert (concurrent["mode"], concurrent["batch_size"], alone["batch_size"]) == ("4 clients", 4, 1)
        assert all(r["failed"] == r["lost"] == 0 and r["tok_per_s"] > 0 for r in (concurrent, alone))
        assert concurrent["equal_to_alone"] == "10/10"
    assert "equal to alone" in report.render([out])


LONG_PROMPT = " ".join(["w9"] * MAX_MODEL_LEN)
CHAT = "chat/completions"


def user(content, **keys) -> list[dict]:
    return [{"role": "user", "content": content} | keys]


BAD_FIELDS = [  # (endpoint, fields, the param the 400 names, the start of its message)
    ("completions", {"max_tokens": True}, "max_tokens", "max_tokens: Input should be a valid integer"),
    ("completions", {"logprobs": True}, "logprobs", "logprobs: Input should be a valid integer"),
    ("completions", {"min_tokens": "1"}, "min_tokens", "min_tokens: Input should be a valid integer"),
    ("completions", {"echo": 1}, "echo", "echo: Input should be a valid boolean"),
    (CHAT, {"logprobs": "true"}, "logprobs", "logprobs: Input should be a valid boolean"),
    (CHAT, {"stream": "yes"}, "stream", "stream: Input should be a valid boolean"),
    ("completions", {"temperature": "0"}, "temperature", "temperature: Input should be a valid number"),
    ("completions", {"top_p": True}, "top_p", "top_p: Input should be a valid number"),
    (CHAT, {"max_completion_tokens": True}, "max_completion_tokens", "max_completion_tokens: Input should be a valid"),
    (CHAT, {"logprobs": True, "top_logprobs": True}, "top_logprobs", "top_logprobs: Input should be a valid integer"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options", "stream_options: only allowed when stream"),
    (
        CHAT,
        {"max_tokens": 5, "max_completion_tokens": 6},
        "max_tokens",
        "max_tokens (5) differs from max_completion_tokens (6), its newer name",
    ),
    ("completions", {"prompt": LONG_PROMPT, "max_tokens": None}, "prompt", "This model's maximum context length"),
    (CHAT, {"messages": user(LONG_PROMPT)}, "messages", "This model's maximum context length"),
    (
        CHAT,
        {"messages": user(LONG_PROMPT), "max_completion_tokens": 4},
        "max_completion_tokens",
        "This model's maximum context length",
    ),
    (
        CHAT,
        {"messages": user([{"type": "text", "text": "w7"}, {"type": "image_url", "image_url": {"url": "x.png"}}])},
        "messages",
        "messages.0.content.1.type: content parts of type 'image_url' are not supported (text only)",
    ),
    (
        CHAT,
        {"messages": user([{"type": "text", "text": "w7", "cache_control": {}}])},
        "messages",
        "messages.0.content.0.cache_control: Extra inputs are not permitted",
    ),
    (CHAT, {"messages": user("w7", foo=1)}, "messages", "messages.0.foo: Extra inputs are not permitted"),
    (
        CHAT,
        {
            "messages": user("w7")
            + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}]
        },
        "messages",
        "messages.1: tool_calls is not supported: this server takes no tools",
    ),
    (
        CHAT,
        {"messages": user("w7", tool_call_id="c")},
        "messages",
        "messages.0: tool_call_id is a tool message's, not a user's",
    ),
]


@pytest.mark.parametrize(("endpoint", "fields", "param", "message"), BAD_FIELDS)
def test_bad_fields_are_named(live: Live, endpoint: str, fields: dict, param: str, message: str) -> None:
    base = {"prompt": "w7", "max_tokens": 4} if endpoint == "completions" else {"messages": user("w7")}
    r = httpx.post(f"{live.url}/v1/{endpoint}", json={"model": NAME} | base | fields, headers=auth())
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"].startswith(message)


def test_integers_in_float_fields_and_an_equal_max_pair(live: Live) -> None:
    """temperature 1 reads as 1.0; max_tokens and max_completion_tokens equal are one cap; a
    message's name passes."""
    body = {"model": NAME, "messages": user("w7", name="ann"), "seed": 3, "max_tokens": 5, "max_completion_tokens": 5}
    texts = []
    for temperature in (1, 1.0):
        r = httpx.post(f"{live.url}/v1/{CHAT}", json=body | {"temperature": temperature}, headers=auth())
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]


def test_a_replayed_response_message_passes(live: Live) -> None:
    """An assistant message as a client replays it from a response (the SDK's message object): its
    null or empty keys of features this server does not serve ask for nothing."""
    replayed = {"role": "assistant", "content": "w5", "refusal": None, "tool_calls": [], "function_call": None}
    body = {"model": NAME, "messages": user("w7") + [replayed] + user("w8"), "max_tokens": 3}
    assert httpx.post(f"{live.url}/v1/{CHAT}", json=body, headers=auth()).status_code == 200
    body["messages"][1] |= {"refusal": "no"}
    r = httpx.post(f"{live.url}/v1/{CHAT}", json=body, headers=auth())
    assert r.status_code == 400 and "messages.1.refusal: Extra inputs are not permitted" in r.json()["error"]["message"]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2's byte-level scheme over one token per byte, and a special token."""
    tokenizer = Tokenizer(models.BPE({char: i for i, char in enumerate(bytes_to_unicode().values())}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>")


def test_chat_logprob_bytes_are_the_tokens_own() -> None:
    """A byte-level token that is half of "é" reports its byte, not the three of the U+FFFD its text
    decodes to; a special token reports its text."""
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("é <|end|>")
    serving = OpenAIServing(SimpleNamespace(tokenizer=tokenizer, engine=SimpleNamespace(max_model_len=8)), None, NAME)
    fmt = ChatFormat("chatcmpl-0", NAME, serving.token_text, token_bytes=serving.token_bytes)
    content = fmt.logprobs([TokenLogprob(i, -1.0, {i: -1.0}) for i in ids]).content
    assert [c.token for c in content] == ["\ufffd", "\ufffd", " ", "<|end|>"]
    assert [c.bytes for c in content] == [[0xC3], [0xA9], [0x20], list(b"<|end|>")]
    assert [c.top_logprobs[0].bytes for c in content] == [c.bytes for c in content]


def test_sentencepiece_token_bytes() -> None:
    """A byte-fallback token is its byte; SentencePiece's \u2581 is a space."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE({"<0xC3>": 0, "\u2581a": 1}, merges=[])))
    assert [vocab_bytes(tokenizer, i) for i in (0, 1)] == [b"\xc3", b" a"]
