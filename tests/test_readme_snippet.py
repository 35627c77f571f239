"""README's "From Python" snippet runs as written, on a tiny Hugging Face Qwen3.5 checkpoint with a tokenizer.

The snippet is read from README.md (the ``python`` block after "From Python:"), its checkpoint path replaced by a
``save_pretrained`` folder of a tiny random ``transformers`` Qwen3.5 with a word-level tokenizer and a
``generation_config.json``, and run in a fresh process with 4 CPU devices (its mesh line takes 4). A README edit
that breaks the snippet fails here.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")  # helpers.hf builds the checkpoint with torch
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from helpers.hf import VOCAB, saved_hf_model  # noqa: E402
from helpers.procs import compile_cache_env  # noqa: E402

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_snippet() -> str:
    """The first ``python`` code block after "From Python:" in README.md."""
    text = README.read_text()
    start = text.index("```python", text.index("From Python:")) + len("```python")
    return text[start: text.index("```", start)]


def _save_tokenizer(path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["[UNK]", "</s>", "The", "capital", "of", "France", "is", "def", "fib", "(", "n", ")", ":"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]  # as many ids as the model's vocabulary
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(path)


@pytest.mark.slow
def test_readme_python_snippet_runs(tmp_path):
    _, path = saved_hf_model(tmp_path, seed=1)
    _save_tokenizer(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [1, 2]}, f)
    code = readme_snippet()
    assert '"path/to/hf_checkpoint"' in code
    code = code.replace('"path/to/hf_checkpoint"', repr(str(path))).replace('"/tmp/kvjax-trace"',
                                                                            repr(str(tmp_path / "trace")))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "KVJAX_COMPILE_CACHE": "off",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip(),
           **compile_cache_env()}
    r = subprocess.run([sys.executable, "-c", code + "\nprint('SNIPPET OK', len(outs), type(texts[0]).__name__)"],
                       env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0 and "SNIPPET OK 2 str" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
