"""A length prior: expected output tokens per workload, from a configurable table.

This is the predictor's fallback (and, until a trained model is loaded, its only source).
Defaults are the output-length means of Preble's Table 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixmesh.shared.wire import ErrorInfo, PredictLengthReply, PredictLengthRequest

# Mean output tokens per workload (Preble Table 1); "default" for anything else.
DEFAULT_TABLE = "toolbench=43,embodied=16,programming=190,videoqa=4,loogle=16,default=128"


@dataclass(frozen=True, slots=True)
class LengthPrior:
    """Predicts a workload's mean output length, clamped to be at least one token."""

    table: dict[str, float] = field(default_factory=dict)
    default: float = 128.0

    @classmethod
    def parse(cls, spec: str) -> LengthPrior:
        """Parse ``"name=tokens,...,default=tokens"``; raises ValueError on bad input."""
        table: dict[str, float] = {}
        default = 128.0
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, sep, value = item.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"bad length-prior entry {item!r}; expected name=tokens")
            tokens = float(value)
            if tokens <= 0:
                raise ValueError(f"length prior for {name!r} must be positive")
            if name.strip() == "default":
                default = tokens
            else:
                table[name.strip()] = tokens
        return cls(table, default)

    def predict(self, req: PredictLengthRequest) -> PredictLengthReply:
        if req.prompt_tokens < 0:
            return PredictLengthReply(request_id=req.request_id, error=ErrorInfo(
                "prompt_tokens must be non-negative", code="bad_request"))
        return PredictLengthReply(request_id=req.request_id,
                                  predicted_tokens=self.table.get(req.workload, self.default))
