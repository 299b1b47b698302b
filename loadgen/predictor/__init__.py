"""Training, evaluation and benchmarks of TRAIL's output-length predictor
(``prefixmesh predictor collect|train|eval|plot``; the [ml] extra)."""
