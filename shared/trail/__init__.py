"""TRAIL's output-length prediction as data: length bins, Bayesian refinement of per-step
readings (``lengths``, numpy only) and the trained artifact's format (``artifact``, torch)."""
