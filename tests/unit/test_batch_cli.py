"""``prefixmesh batch plan``: a Batch API input file planned without running it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixmesh.services.cli import main as cli_main
from prefixmesh.shared.text.gguf_vocab import ensure_default_tokenizer
from tests.helpers import span


@pytest.fixture
def tokenizer(tokenizer_dir: Path) -> str:
    return str(ensure_default_tokenizer(tokenizer_dir))


def _line(custom_id: str, body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _plan(tmp_path: Path, tokenizer: str, lines: list[str], *extra: str) -> tuple[int, Path]:
    src, out = tmp_path / "in.jsonl", tmp_path / "plan" / "out.json"
    src.write_text("\n".join(lines) + "\n")
    rc = cli_main(["batch", "plan", str(src), "--json", str(out), "--tokenizer", tokenizer,
                   *extra])
    return rc, out


def test_the_instruction_document_question_batch(tmp_path: Path, tokenizer: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # docs/batch.md's example as token-id prompts: a 50-token instruction, six 2,000-token
    # documents (three starting with one token, three with another), four 2-token
    # questions on each.
    docs = [[7 if d < 3 else 8] + span(10_000 + 2_000 * d, 1999) for d in range(6)]
    lines = [_line(f"d{d}q{q}", {"model": "any", "max_tokens": 8,
                                 "prompt": span(1, 50) + doc + span(40_000 + 10 * (4 * d + q), 2)})
             for d, doc in enumerate(docs) for q in range(4)]
    rc, out = _plan(tmp_path, tokenizer, lines)
    assert rc == 0
    plan = json.loads(out.read_text())
    assert plan["requests"] == 24 and plan["prompt_tokens"] == 24 * 2052
    assert plan["saved_fraction"] == pytest.approx(0.749, abs=5e-4)
    assert plan["multi_level_saved_fraction"] == pytest.approx(0.754, abs=5e-4)
    assert plan["naive_first_level_saved_fraction"] == pytest.approx(0.023, abs=5e-4)
    assert sorted(g["custom_ids"] for g in plan["groups"]) == [
        [f"d{d}q{q}" for q in range(4)] for d in range(6)]
    assert {g["prefix_tokens"] for g in plan["groups"]} == {2050}
    printed = capsys.readouterr().out
    assert "74.9% saved" in printed and "75.4%" in printed


def test_chat_lines_are_tokenized_and_grouped_by_document(tmp_path: Path, tokenizer: str,
                                                          ) -> None:
    doc = "The harbour log names every ship, its flag and its cargo. " * 15
    lines = [_line(f"d{d}q{q}", {"model": "m", "messages": [
        {"role": "system", "content": "Answer from the document."},
        {"role": "user", "content": f"Document {d}. {doc}\nQuestion {q}: which flags?"}]},
        url="/v1/chat/completions") for d in range(3) for q in range(5)]
    lines.insert(4, "")  # blank lines are skipped, as the edge does
    rc, out = _plan(tmp_path, tokenizer, lines, "--workers", "2")
    assert rc == 0
    plan = json.loads(out.read_text())
    groups = plan["groups"]
    assert sorted(i for g in groups for i in g["custom_ids"]) == sorted(
        f"d{d}q{q}" for d in range(3) for q in range(5))
    assert len(groups) == 3 and all(g["prefix_tokens"] > 150 for g in groups)
    assert {g["worker"] for g in groups} == {"worker0", "worker1"}
    assert 0.5 < plan["saved_fraction"] <= plan["multi_level_saved_fraction"] < 1


def test_a_bad_file_names_each_line_and_what_is_wrong(tmp_path: Path, tokenizer: str,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    ok = {"model": "m", "prompt": "hello"}
    rc, out = _plan(tmp_path, tokenizer, [
        _line("a", ok), "{not json", _line("a", ok), _line("c", ok, "/v1/chat/completions")])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert "in.jsonl:2: JSON is malformed" in err
    assert "in.jsonl:3: custom_id 'a' is not unique" in err
    assert "in.jsonl:4: url '/v1/chat/completions' differs" in err
    # Well-formed lines whose bodies the edge would refuse, numbered as in the file.
    rc, out = _plan(tmp_path, tokenizer, [
        _line("a", ok), "", _line("b", {"model": "m", "prompt": "x", "max_tokens": 0}),
        _line("c", {"model": "m"})])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert "in.jsonl:3: custom_id 'b': body.max_tokens: max_tokens must be at least 1" in err
    assert "in.jsonl:4: custom_id 'c': body.prompt: prompt is required" in err
    assert cli_main(["batch", "plan", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: cannot read" in capsys.readouterr().err


def test_batch_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["batch", "--help"])
    assert exit_.value.code == 0
    assert "plan" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli_main(["batch", "plan", "--help"])
    assert exit_.value.code == 0
    assert "saved_fraction" in capsys.readouterr().out
