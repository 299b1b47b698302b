"""Engine backends behind the worker: ``sim`` (a simulated GPU scheduled like vLLM, pure
logic driven by the caller's clock; ``sim.SimEngine``) and ``vllm`` (``vllm_engine``).

Import from the modules themselves (``engine.sim``, ``engine.types``): this package
re-exports nothing, so importing a light module such as ``engine.types`` never drags in
the engine, and the local policies (which need ``engine.types``) can be imported first.
"""
