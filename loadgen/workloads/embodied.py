"""``embodied``: ReAct agents in ALFWorld (Preble Table 1: 2285/471 prompt, 16/13 output, 97%).

The prompt is ReAct's ALFWorld prompt: an instruction, ``demos`` real trajectories as
few-shot demonstrations (by default two of the task's type, as ReAct does; more come from
other types), then the task. An episode replays a real trajectory of
``alfworld_3prompts.json`` (never one of its own demos) step by step: request k's prompt is
request k-1's prompt + its action + the environment's observation, and its output is the
action the trajectory took there (real lengths, ~16/18 tokens). A per-episode line ("Here
is the task (episode 7).") keeps episodes replaying the same trajectory distinct;
everything before it is the demo prefix shared by all episodes of that task, everything up
to the previous step is shared with the episode's earlier request.

Episodes run ``agents`` at a time: the request list interleaves them, and each episode's
steps keep their order (a step's arrival should follow its predecessor's completion; the
list order is the best a replay without feedback can do).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from prefixmesh.loadgen.workloads.base import (
    WorkloadOptions,
    WorkloadRequest,
    encode,
    interleave_sessions,
    pick_prefixes,
    stable_seed,
    variant_tokens,
)
from prefixmesh.loadgen.workloads.sources import (
    AlfworldTrajectory,
    alfworld_trajectories,
)

# ReAct's ALFWorld prompt (its alfworld.ipynb), with the number of examples filled in.
REACT_INSTRUCTION = "Interact with a household to solve a task. Here are {n} examples.\n"
REACT_TASK = "\nHere is the task (episode {e}).\n"


@dataclass(frozen=True, slots=True)
class EmbodiedOptions(WorkloadOptions):
    """``prefixes``: distinct demo prefixes (default 18, one per task trajectory; more are
    salted variants); ``zipf``: their popularity (default equal); ``demos``: few-shot
    trajectories per prompt; ``agents``: episodes interleaved at once."""

    # ReAct's ALFWorld prompt has two demonstrations of the task's type.
    demos: int = 2
    # Episodes in flight at once in the request order.
    agents: int = 16


def _demos_for(task: int, trajs: list[AlfworldTrajectory], n: int) -> list[int]:
    """Demo trajectories for task ``task``: its type's other ones first, then other types'."""
    same = [i for i, t in enumerate(trajs) if t.task_type == trajs[task].task_type and i != task]
    others = [i for i in range(task + 1, len(trajs))] + list(range(task))
    others = [i for i in others if i not in same]
    return (same + others)[:n]


def build(count: int, seed: int, opts: EmbodiedOptions) -> list[WorkloadRequest]:
    """``count`` agent steps as token ids, episodes interleaved."""
    if opts.demos < 0 or opts.demos >= len(alfworld_trajectories()):
        raise ValueError(f"demos must be in [0, {len(alfworld_trajectories()) - 1}]")
    if opts.agents < 1:
        raise ValueError("agents must be at least 1")
    trajs = alfworld_trajectories()
    n_real = len(trajs)
    n_prefixes = opts.prefixes or n_real
    rng = random.Random(stable_seed("embodied", seed))
    order = list(range(n_real))
    rng.shuffle(order)
    instruction = encode(REACT_INSTRUCTION.format(n=opts.demos))
    shared: dict[int, list[int]] = {}
    sessions: list[list[WorkloadRequest]] = []
    total = 0
    episode = 0
    while total < count:
        # Draw episodes' prefixes in chunks so an episode's prefix does not depend on count.
        for p in pick_prefixes(rng, n_prefixes, n_prefixes, opts.zipf):
            if total >= count:
                break
            task = order[p % n_real]
            if p not in shared:
                demo_ids = _demos_for(task, trajs, opts.demos)
                prefix = instruction + variant_tokens("agent", p, n_real)
                for d in demo_ids:
                    prefix = prefix + trajs[d].text
                shared[p] = prefix
            steps = _episode(trajs[task], shared[p], f"alf{p}", f"ep{episode}", episode,
                             count - total, opts.tenant)
            sessions.append(steps)
            total += len(steps)
            episode += 1
    return interleave_sessions(rng, sessions, opts.agents)


def _episode(traj: AlfworldTrajectory, prefix: list[int], prefix_id: str, session: str,
             episode: int, limit: int, tenant: str) -> list[WorkloadRequest]:
    """One episode's requests (at most ``limit``): each prompt extends the previous one."""
    prompt = prefix + encode(REACT_TASK.format(e=episode)) + traj.observation
    shared = len(prefix)
    out: list[WorkloadRequest] = []
    for k, action in enumerate(traj.actions[:limit]):
        out.append(WorkloadRequest(prompt=prompt, max_tokens=action, prefix_id=prefix_id,
                                   output_len=action, tenant=tenant, shared_tokens=shared,
                                   session=session))
        shared = len(prompt)
        prompt = prompt + traj.steps[k]
    return out
