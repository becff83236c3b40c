"""vLLM's own validation of the engine's model settings, from config.json alone.

vLLM checks ``max_model_len`` against the length the model's config allows (position
embeddings, RoPE scaling) only when the engine is built. Building vLLM's ``ModelConfig`` with the
values the engine will get raises the same error before the model load — measured on the tiny
Llama with the default max_model_len 4096: preflight passed, then every chunk failed.

It runs in a child process: building a ``ModelConfig`` changes process-wide state (vLLM
registers config classes with transformers and patches configs as it reads them), and the probe,
which builds an HF reference model in this process, then failed on DeepSeek and Kimi configs.
The child starts first and runs beside the other checks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hsx.engine.options import resolve_dtype
from hsx.preflight.report import CheckResult, Status
from settings import EngineSettings

CHECK = "engine-config"
_TIMEOUT_S = 180

_CHILD = """
import json, sys
args = json.loads(sys.argv[1])
try:
    from vllm.config import ModelConfig
    config = ModelConfig(skip_tokenizer_init=True, **args)
    print(json.dumps({"ok": True, "max_model_len": config.max_model_len,
                      "dtype": str(config.dtype).removeprefix("torch.")}))
except Exception as exc:  # pydantic's ValidationError carrying vLLM's message
    print(json.dumps({"ok": False, "error": str(exc) or repr(exc)}))
"""


class EngineConfigCheck:
    """Started at construction (a child process), read by ``result``."""

    def __init__(self, model_dir: Path, engine: EngineSettings, config: dict[str, Any]) -> None:
        self.max_model_len = engine.max_model_len
        self.dtype = resolve_dtype(engine, config)
        args = {
            "model": str(model_dir),
            "tokenizer": str(model_dir),
            "dtype": self.dtype,
            "max_model_len": engine.max_model_len,
            "seed": engine.seed,
        }
        self._child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def result(self) -> CheckResult:
        try:
            out, err = self._child.communicate(timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.communicate()
            return CheckResult(
                CHECK, Status.WARN, f"vLLM's ModelConfig did not answer within {_TIMEOUT_S} s"
            )
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if not lines:
            tail = (err.strip().splitlines() or ["no output"])[-1]
            return CheckResult(
                CHECK,
                Status.FAIL,
                f"expected vLLM's ModelConfig to answer, found exit {self._child.returncode}: {tail}",
            )
        answer = json.loads(lines[-1])
        if answer["ok"]:
            return CheckResult(
                CHECK,
                Status.PASS,
                f"vLLM accepts the model settings: max_model_len {answer['max_model_len']}, "
                f"dtype {answer['dtype']}",
            )
        detail = [line.strip() for line in str(answer["error"]).splitlines() if line.strip()]
        reason = next((line for line in detail if line.startswith("Value error, ")), detail[0])
        return CheckResult(
            CHECK,
            Status.FAIL,
            f"vLLM refuses engine.max_model_len {self.max_model_len} / dtype {self.dtype} for "
            f"this model: {reason.removeprefix('Value error, ')}",
            tuple(detail),
        )
