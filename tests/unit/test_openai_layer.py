"""The OpenAI layer shared by the edge and the standalone worker (shared/openai) and the
model cards behind its context-length limit (shared/models.py)."""

from __future__ import annotations

import json

import pytest

from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.shared.models import DEFAULT_MODEL, SMOLLM2, known_cards, sim_card
from prefixmesh.shared.openai.choices import check_context, fan_out, first_of_prompt
from prefixmesh.shared.openai.schema import ApiError, parse_chat, parse_completion
from prefixmesh.shared.wire import SamplingParams

MODELS = {"m": 100}


def _completion(**body) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **body}).encode()


def test_parsed_sampling_is_the_wire_struct_with_everything_asked_for() -> None:
    p = parse_completion(_completion(max_tokens=3, logprobs=2, allowed_token_ids=[5, 5, 7],
                                     stop="x", seed=4), MODELS, vocab_size=50)
    assert p.sampling == SamplingParams(max_tokens=3, seed=4, stop=["x"], logprobs=2,
                                        allowed_token_ids=[5, 7])


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_penalties_reach_the_worker_and_are_bounded_as_openai_bounds_them(name: str) -> None:
    assert getattr(parse_completion(_completion(**{name: -1.5}), MODELS, 50).sampling,
                   name) == -1.5
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                       name: 2}).encode()
    assert getattr(parse_chat(chat, MODELS).sampling, name) == 2.0
    assert getattr(parse_completion(_completion(**{name: None}), MODELS, 50).sampling,
                   name) == 0.0
    with pytest.raises(ApiError) as err:
        parse_completion(_completion(**{name: 2.5}), MODELS, vocab_size=50)
    assert err.value.status == 400 and err.value.param == name
    assert f"{name} must be between -2 and 2, got 2.5" in err.value.message


@pytest.mark.parametrize(("extra", "param"), [
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
])
def test_options_no_backend_serves_are_refused_not_dropped(extra: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_completion(_completion(**extra), MODELS, vocab_size=50)
    assert err.value.status == 400 and err.value.param == param
    assert param in err.value.message and "not supported" in err.value.message
    # Their empty or neutral values pass, as clients often send them.
    for neutral in ({"logit_bias": {}}, {"response_format": {"type": "text"}},
                    {"best_of": 2, "n": 2}, {"suffix": ""}):
        assert parse_completion(_completion(**neutral), MODELS, vocab_size=50)


def test_chat_refuses_tools_it_cannot_call() -> None:
    def chat(**extra) -> bytes:
        return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                           **extra}).encode()

    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    for extra, param in (({"tools": [tool]}, "tools"), ({"tool_choice": "auto"}, "tool_choice")):
        with pytest.raises(ApiError) as err:
            parse_chat(chat(**extra), MODELS)
        assert err.value.status == 400 and err.value.param == param
    assert parse_chat(chat(tools=[], tool_choice="none"), MODELS).kind == "chat"


@pytest.mark.parametrize("max_tokens", [100, 5000])
def test_max_tokens_beyond_the_context_is_a_400_that_says_so(max_tokens: int) -> None:
    with pytest.raises(ApiError) as err:
        parse_completion(_completion(max_tokens=max_tokens), MODELS, vocab_size=50)
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    assert "maximum context length is 100 tokens" in err.value.message
    assert err.value.param == "max_tokens"
    ok = parse_completion(_completion(max_tokens=99), MODELS, vocab_size=50)
    assert ok.sampling.max_tokens == 99


def test_chat_uses_the_requested_models_context() -> None:
    body = json.dumps({"model": "small", "messages": [{"role": "user", "content": "x"}],
                       "max_completion_tokens": 20}).encode()
    assert parse_chat(body, {"small": 64, "big": 10}).sampling.max_tokens == 20
    with pytest.raises(ApiError, match="maximum context length is 10"):
        parse_chat(body.replace(b'"small"', b'"big"'), {"small": 64, "big": 10})


def test_prompt_plus_max_tokens_must_fit() -> None:
    check_context([[1] * 90], 10, 100)
    with pytest.raises(ApiError) as err:
        check_context([[1] * 10, [1] * 91], 10, 100)
    assert err.value.code == "context_length_exceeded" and "prompt has 91" in err.value.message


def test_choices_fan_out_per_prompt_and_n() -> None:
    one = fan_out("r", [[1, 2]], 1)
    assert [(c.index, c.request_id) for c in one] == [(0, "r")]
    many = fan_out("r", [[1], [2]], 2)
    assert [(c.index, c.request_id, c.token_ids) for c in many] == [
        (0, "r-0", [1]), (1, "r-1", [1]), (2, "r-2", [2]), (3, "r-3", [2])]
    assert first_of_prompt(2, 2) == {0, 2}


def test_model_cards() -> None:
    assert SMOLLM2.context_length == 8192 and not SMOLLM2.simulated
    sim = sim_card("mistral-7b-a6000")
    assert sim.name == "mistral-7b-a6000-sim" and sim.simulated
    assert sim.context_length == 32768  # Mistral-7B's positions
    assert sim_card("llama3-70b-h100-tp2").context_length == 8192
    assert DEFAULT_MODEL in known_cards()


def test_workers_and_the_edge_take_the_length_from_the_card() -> None:
    assert WorkerConfig().served_model() == sim_card("mistral-7b-a6000")
    assert WorkerConfig(backend="hf").served_model() == SMOLLM2
    assert WorkerConfig(max_model_len=64).served_model().context_length == 64
    with pytest.raises(SystemExit, match="needs --model"):
        WorkerConfig(backend="vllm").served_model()
    assert EdgeConfig().context_lengths == {DEFAULT_MODEL: 32768}
    assert EdgeConfig(models="smollm2-135m-instruct").context_lengths == {
        "smollm2-135m-instruct": 8192}
    with pytest.raises(SystemExit, match="--max-model-len"):
        _ = EdgeConfig(models="my-own-model").context_lengths
    assert EdgeConfig(models="my-own-model", max_model_len=4096).context_lengths == {
        "my-own-model": 4096}


def test_a_servers_own_cap_on_max_tokens() -> None:
    with pytest.raises(ApiError, match="at most 4 on this server"):
        parse_completion(_completion(max_tokens=5), MODELS, vocab_size=50, max_tokens_cap=4)
    assert parse_completion(_completion(), MODELS, 50, max_tokens_cap=4).sampling.max_tokens == 4
