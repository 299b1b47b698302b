"""``prefixmesh batch``: offline batches from the command line (docs/batch.md).

``prefixmesh batch plan FILE.jsonl --json OUT`` shows what the edge's batch planner would
do with a Batch API input file without running it (``PLAN_HELP``): lines checked as the
edge checks them, tokenized as the tokenizer service does, planned by
``services/edge/batch_plan.plan_batch``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from prefixmesh.services.edge.batch_format import ENDPOINTS, BatchLine, LineError, parse_lines
from prefixmesh.services.edge.batch_plan import BatchPlan, computed_tokens, plan_batch, saving_ratio
from prefixmesh.shared.costmodel import DEFAULT_PROFILE, CostModel
from prefixmesh.shared.openai.schema import ApiError, ParsedRequest, parse_chat, parse_completion
from prefixmesh.shared.text.gguf_vocab import GgufTokenizerError
from prefixmesh.shared.text.requests import BadRequest, tokenize
from prefixmesh.shared.text.tokenizer import TextTokenizer
from prefixmesh.shared.wire import TokenizeRequest

# Context length assumed for every model: the plan does not check prompts against one.
NO_CONTEXT_LIMIT = 2**31
# Token ids a prompt given as ids must stay below (the edge's default vocab_size).
VOCAB_SIZE = 49152
# Lines between two progress messages while tokenizing.
PROGRESS_EVERY = 5000
PLAN_HELP = """Show what the batch planner would do with a Batch API input file, without
running it. Every line is checked as the edge checks a batch (line format, then each
request body; any model name is accepted and no context length is enforced), its first
prompt is tokenized with the mesh's tokenizer, and the batch is planned: prefix tree,
MaximizeReuse, prefix groups, placement on --workers workers. Printed: a short summary.
Written with --json: the groups (each worker's in run order, with their custom_ids),
saved_fraction (the share of prompt tokens the plan does not compute) and its upper bound
multi_level_saved_fraction (every shared prefix computed once). Exit status 2 and one
FILE:LINE: message per problem for a bad file."""


class BadFile(Exception):
    """An input file the plan cannot be made from; ``errors`` are ``FILE:LINE: what`` lines."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


class _AnyModel(Mapping[str, int]):
    """Every model name is served, with no context limit (the plan checks neither)."""

    def __getitem__(self, name: str) -> int:
        return NO_CONTEXT_LIMIT

    def __contains__(self, name: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def read_lines(path: Path) -> tuple[list[BatchLine], list[int]]:
    """The file's lines, checked as the edge checks a batch's input, and each one's line
    number in the file; BadFile otherwise."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadFile([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    endpoint = _endpoint(data)
    lines, errors = parse_lines(data, endpoint or ENDPOINTS[0])
    if errors:
        raise BadFile([_where(path, e) for e in errors])
    numbers = [n for n, raw in enumerate(data.splitlines(), 1) if raw.strip()]
    return lines, numbers


def _endpoint(data: bytes) -> str | None:
    """The url of the first line that has one: every line must then use it."""
    for raw in data.splitlines():
        try:
            url = json.loads(raw).get("url")
        except (ValueError, AttributeError):
            continue
        if url in ENDPOINTS:
            return str(url)
    return None


def _where(path: Path, e: LineError) -> str:
    message = e.message.removeprefix(f"line {e.line}: ")
    return f"{path}:{e.line}: {message}" if e.line else f"{path}: {message}"


def prompts_of(path: Path, lines: Sequence[BatchLine], numbers: Sequence[int],
               tok: TextTokenizer, progress: bool = False) -> tuple[list[list[int]], list[int]]:
    """Each line's first prompt as token ids and its max_tokens; BadFile naming every line
    (by its ``numbers`` entry) whose body the edge would refuse."""
    prompts: list[list[int]] = []
    outputs: list[int] = []
    errors: list[str] = []
    for k, (n, line) in enumerate(zip(numbers, lines, strict=True), 1):
        try:
            parsed = _parse(line)
            prompts.append(_first_prompt(tok, parsed))
            outputs.append(parsed.sampling.max_tokens)
        except ApiError as err:
            where = f"body.{err.param}: " if err.param else "body: "
            errors.append(f"{path}:{n}: custom_id {line.custom_id!r}: {where}{err.message}")
        except BadRequest as err:
            errors.append(f"{path}:{n}: custom_id {line.custom_id!r}: body: {err}")
        if progress and k % PROGRESS_EVERY == 0:
            print(f"tokenized {k}/{len(lines)} lines", file=sys.stderr)
    if errors:
        raise BadFile(errors)
    return prompts, outputs


def _parse(line: BatchLine) -> ParsedRequest:
    body = json.dumps(line.body).encode()
    if line.url == "/v1/chat/completions":
        return parse_chat(body, _AnyModel())
    return parse_completion(body, _AnyModel(), VOCAB_SIZE)


def _first_prompt(tok: TextTokenizer, parsed: ParsedRequest) -> list[int]:
    if parsed.kind == "chat":
        return tokenize(tok, TokenizeRequest(request_id="", messages=parsed.messages))
    first = parsed.prompts[0]
    if isinstance(first, list):
        return first
    return tokenize(tok, TokenizeRequest(request_id="", text=first))


def plan_report(lines: Sequence[BatchLine], prompts: Sequence[Sequence[int]],
                outputs: Sequence[int], workers: int, profile: str) -> dict[str, Any]:
    """The plan of ``prompts`` on ``workers`` workers, as the JSON the verb writes."""
    names = [f"worker{i}" for i in range(workers)]
    plan: BatchPlan = plan_batch(prompts, outputs, names, CostModel.load(profile))
    lengths = [len(p) for p in prompts]
    placed = [g for gs in plan.placement.groups.values() for g in gs]
    computed = computed_tokens(placed, lengths)  # split groups recompute their prefix
    groups = [{"worker": w, "prefix_tokens": g.prefix_len, "requests": len(g.members),
               "computed_tokens": g.tokens(lengths),
               "custom_ids": [lines[i].custom_id for i in g.members]}
              for w, gs in plan.placement.groups.items() for g in gs]
    return {
        "requests": len(prompts), "prompt_tokens": plan.total_tokens,
        "computed_prompt_tokens": computed,
        "saved_fraction": round(saving_ratio(computed, plan.total_tokens), 6),
        "multi_level_saved_fraction": round(
            saving_ratio(plan.multilevel_tokens, plan.total_tokens), 6),
        "naive_first_level_saved_fraction": round(
            saving_ratio(plan.naive_tokens, plan.total_tokens), 6),
        "workers": workers, "profile": profile,
        "imbalance": round(plan.placement.imbalance, 4),
        "work_s": {w: round(s, 4) for w, s in plan.placement.work_s.items()},
        "groups": groups,
    }


def summary(path: Path, report: dict[str, Any]) -> str:
    """A few lines for a person."""
    shared = sum(1 for g in report["groups"] if g["prefix_tokens"])
    workers = f"{report['workers']} worker" + ("s" if report["workers"] > 1 else "")
    return "\n".join([
        f"{path}: {report['requests']} requests, {report['prompt_tokens']:,} prompt tokens",
        f"plan: {len(report['groups'])} groups ({shared} sharing a prefix) on {workers}; "
        f"{report['computed_prompt_tokens']:,} prompt tokens computed, "
        f"{report['saved_fraction']:.1%} saved",
        f"upper bound (every shared prefix computed once): "
        f"{report['multi_level_saved_fraction']:.1%}; sharing only the root's children: "
        f"{report['naive_first_level_saved_fraction']:.1%}",
    ])


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.workers < 1:
        print("--workers must be at least 1", file=sys.stderr)
        return 2
    try:
        lines, numbers = read_lines(args.file)
        tok = _tokenizer(args.tokenizer)
        prompts, outputs = prompts_of(args.file, lines, numbers, tok,
                                      progress=len(lines) > PROGRESS_EVERY)
    except BadFile as bad:
        for e in bad.errors:
            print(e, file=sys.stderr)
        print(f"{len(bad.errors)} error(s); nothing planned", file=sys.stderr)
        return 2
    report = plan_report(lines, prompts, outputs, args.workers, args.profile)
    report["file"] = str(args.file)
    print(summary(args.file, report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _tokenizer(path: str | None) -> TextTokenizer:
    try:
        return TextTokenizer.load(path)
    except GgufTokenizerError as exc:
        raise BadFile([f"no tokenizer: {exc}"]) from None
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions
        raise BadFile([f"cannot load the tokenizer {path!r}: {exc}"]) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixmesh batch", description="Offline batches (OpenAI Batch API input files).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = sub.add_parser(
        "plan", help="show the planner's groups and prefill-token saving for an input file",
        description=PLAN_HELP)
    p.add_argument("file", type=Path, metavar="FILE.jsonl",
                   help="Batch API input: one {custom_id, method, url, body} object a line")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="write the plan here as JSON (groups, saved_fraction, upper bound)")
    p.add_argument("--workers", type=int, default=1,
                   help="workers to place the groups on (default: 1)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"cost model balancing the placement (default: {DEFAULT_PROFILE})")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json or its folder (default: SmolLM2's, as the mesh uses)")
    p.set_defaults(run=_cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
