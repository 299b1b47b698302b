"""The models a worker can serve: their names and context lengths, written once.

A request's prompt plus ``max_tokens`` must fit the served model's context length; the
edge and the standalone worker refuse anything longer with a 400, as vLLM does.

- ``hf`` serves SmolLM2-135M-Instruct (8,192 positions).
- ``sim`` serves no real model: it imitates the GPU time of a cost-model profile
  (``shared/profiles``), so it serves ``<profile>-sim`` (for example
  ``mistral-7b-a6000-sim``), a name that says it is simulated, with the context length of
  the model the profile measured. Its text is made of SmolLM2 token ids.
- ``vllm`` serves whatever ``--model`` names; its context length comes from the config
  (``--max-model-len``) or, when unset, vLLM's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixmesh.shared.costmodel import DEFAULT_PROFILE, CostModel, available_profiles

SIM_SUFFIX = "-sim"


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What clients see of a served model."""

    name: str
    # Prompt plus output tokens at most.
    context_length: int
    # True when no model runs: the outputs are simulated (token ids, not meaningful text).
    simulated: bool = False


SMOLLM2 = ModelCard("smollm2-135m-instruct", 8192)


def sim_card(profile: str) -> ModelCard:
    """The model a simulated GPU on ``profile`` serves."""
    cost = CostModel.load(profile)
    if cost.context_length < 1:
        raise ValueError(f"profile {profile!r} names no context_length")
    return ModelCard(cost.name + SIM_SUFFIX, cost.context_length, simulated=True)


DEFAULT_MODEL = sim_card(DEFAULT_PROFILE).name


def known_cards() -> dict[str, ModelCard]:
    """Every model prefixmesh knows the context length of, by served name."""
    cards = [SMOLLM2, *(sim_card(p) for p in available_profiles())]
    return {c.name: c for c in cards}


def card_for(backend: str, profile: str, model: str = "") -> ModelCard | None:
    """The card of what a worker with this config serves (None: a vllm model whose length
    only vLLM knows)."""
    if backend == "sim":
        return sim_card(profile)
    if backend == "hf":
        return SMOLLM2
    return known_cards().get(model)
