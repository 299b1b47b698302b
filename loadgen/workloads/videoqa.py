"""``videoqa``: questions about videos (Preble Table 1: 9865/5976 prompt, 4/1.5 output, 88%).

Prompt = a LLaVA-style system prompt + the video's tokens + a real NExT-QA multiple-choice
question with its five options. There is no video: as Preble does, a video is
``frame_count / 30 * 256`` token ids (256 per second of 30 fps video), drawn once from a
generator seeded by the video id, so the same video is the same tokens in every build and
process. The system prompt and video tokens are the shared prefix; a video's questions all
share it. Output = the correct option's text in SmolLM2 tokens (real).

By default each video brings all of its real questions (8.6 on average, test.csv first,
then val.csv) until ``count`` is reached, and the requests are shuffled (as Preble's
generator shuffles its workloads). With ``prefixes`` or ``zipf`` set, requests are spread
over that many videos (equally, or Zipf-popular), each cycling through its questions.
Videos past the 1,570 of the data are variants: the same frame count and questions, other
token ids.
"""

from __future__ import annotations

import random

import numpy as np

from prefixmesh.loadgen.workloads.base import (
    FIRST_REGULAR_ID,
    VOCAB_SIZE,
    WorkloadOptions,
    WorkloadRequest,
    encode,
    next_turn,
    prefix_items,
    stable_seed,
    system_turn,
)
from prefixmesh.loadgen.workloads.sources import NEXTQA_FILES, nextqa_data

VIDEO_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
                "The assistant gives helpful, detailed, and polite answers to the human's "
                "questions.")
VIDEO_OPEN = "<video>"
VIDEO_CLOSE = "</video>\n"
VIDEO_INSTRUCTION = "Answer with the text of the correct option."
# Preble: a video of F frames is F/30*256 tokens (256 visual tokens per second at 30 fps).
TOKENS_PER_SECOND = 256
FRAMES_PER_SECOND = 30


def video_tokens(video: str, frame_count: int, variant: int = 0) -> list[int]:
    """The synthetic token ids of one video: same id, frames and variant -> same tokens."""
    n = frame_count * TOKENS_PER_SECOND // FRAMES_PER_SECOND
    gen = np.random.default_rng(stable_seed("video", video, variant))
    return gen.integers(FIRST_REGULAR_ID, VOCAB_SIZE, size=n).tolist()


def build(count: int, seed: int, opts: WorkloadOptions) -> list[WorkloadRequest]:
    """``count`` VideoQA requests as token ids."""
    # Options: ``prefixes``, videos (default: as many as ``count`` needs, all questions of
    # each); ``zipf``, video popularity when set (default equal).
    data = nextqa_data()
    videos = data.videos
    n_real = len(videos)
    rng = random.Random(stable_seed("videoqa", seed))
    # Test-split videos first (the split Preble's figures match), each split shuffled.
    order: list[int] = []
    for split in NEXTQA_FILES:
        part = [i for i, v in enumerate(videos) if v.split == split]
        rng.shuffle(part)
        order.extend(part)

    # (prefix, question index) of each request; prefix p is video order[p % n_real].
    picks = [(p, videos[order[p % n_real]].questions[k]) for p, k in prefix_items(
        rng, count, lambda p: len(videos[order[p % n_real]].questions), opts.prefixes,
        opts.zipf, n_real)]
    data.questions.prefetch(q for _, q in picks)
    data.answers.prefetch(q for _, q in picks)

    head = system_turn(VIDEO_SYSTEM) + next_turn("user") + encode(VIDEO_OPEN)
    close = encode(VIDEO_CLOSE)
    tail = encode(VIDEO_INSTRUCTION) + next_turn("assistant")
    shared: dict[int, list[int]] = {}
    out: list[WorkloadRequest] = []
    for p, q in picks:
        if p not in shared:
            v = videos[order[p % n_real]]
            shared[p] = head + video_tokens(v.video, v.frame_count, p // n_real) + close
        pre = shared[p]
        n_out = len(data.answers[q])
        out.append(WorkloadRequest(prompt=pre + data.questions[q] + tail, max_tokens=n_out,
                                   prefix_id=f"video{p}", output_len=n_out,
                                   tenant=opts.tenant, shared_tokens=len(pre)))
    return out
