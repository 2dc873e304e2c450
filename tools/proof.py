"""Proof that the native code is the code that ran: one generation in vLLM with ActiveKV, checked from the run itself.

Usage::

    python -m tools.proof --model DIR [--plant frame,reference] [--json FILE]

Runs in its own (fresh) process, which is the serving process: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` vLLM's
engine core and its worker run here (``tools.vllm_run``). It generates ``--max-tokens`` tokens for a batch of prompts
with ActiveKV and checks:

(a) **native entry counts**: over the generation, the native engine's ``build_calls`` equals the steps, and
    ``forward_calls`` and ``kv_update_calls`` equal layers x steps, where the steps are counted on vLLM's side (the
    sample count of vLLM's ``vllm:iteration_tokens_total`` histogram: one sample per scheduler iteration) and the
    layers are the model's (its config.json), never ActiveKV's own counters;
(b) **the Python reference never ran**: an audit hook installed before anything else is imported records every
    import; no module of ``tests.reference`` (nor any file under ``tests/reference/``) may be imported by the end;
(c) **no Python frames from ActiveKV code but the contract delegates**: ``sys.setprofile`` (and
    ``threading.setprofile``) records, during the generation, every Python frame whose code lives in a file the patch
    series adds (or under ``tests/reference/``). Each must be one of the series' ``def`` lines (the one-line contract
    delegates of ``tools.contracts``); the report counts them per step, and every native call they make
    (``c_call`` events: the callee's type) is listed. Any other frame there fails the check.

``--plant`` is the control: ``frame`` replaces ``ActiveKVImpl.forward`` with a wrapper compiled into the backend
module's file (one extra Python frame per layer and step in the ActiveKV path, which then calls the real delegate);
``reference`` imports ``tests.reference.engine`` in the serving process before generating. Each plant must make its
check fail (``tests/test_e2e_vllm.py`` runs both). Exit status 0 when every check passes, 1 when one fails.
The report (stdout, and ``--json FILE``) is described in docs/telemetry.md ("Reading the proof report").
"""

from __future__ import annotations

import sys

_IMPORTED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "import":
        _IMPORTED.append(str(args[0]))


sys.addaudithook(_audit)  # first: every later import is seen

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
REFERENCE_DIR = REPO / "tests" / "reference"
REFERENCE_MODULE = "tests.reference"
PROMPT_LENGTHS = (37, 200, 513, 64)
EXACT = {"mode": "exact", "pool_blocks": 8, "tile_blocks": 4}
BLOCK_SIZE = 16


def delegate_defs() -> dict[str, dict[int, str]]:
    """{file the series adds (relative to vllm's root): {def line: function name}}: the only ActiveKV Python frames
    allowed. Line numbers are those of the patched file (the series' hunks say them)."""
    from tools.contracts import added_python_lines
    from tools.vllm_patch import DEFAULT_PATCHES, Series

    defs: dict[str, dict[int, str]] = {}
    for a in added_python_lines(Series.load(DEFAULT_PATCHES)):
        if a.new_file:
            defs.setdefault(a.file, {})
            if a.text.startswith("def "):
                defs[a.file][a.lineno] = a.text[4:].split("(", 1)[0]
    return defs


class FrameProfile:
    """sys.setprofile hook: Python frames of watched files, what the delegates call, and Python entered under them."""

    def __init__(self, watched: dict[str, dict[int, str]]) -> None:
        self.watched = watched  # {absolute file: {def line: name}}
        self.delegates: Counter[str] = Counter()
        self.foreign: Counter[str] = Counter()
        self.c_calls: Counter[str] = Counter()  # builtins called from a delegate frame (3.11 reports positional calls)
        self.python_under_delegates: Counter[str] = Counter()  # Python frames whose caller frame is a delegate
        self._cache: dict[Any, tuple[str, bool] | None] = {}

    def _classify(self, code: Any) -> tuple[str, bool] | None:
        hit = self._cache.get(code, False)
        if hit is not False:
            return hit  # type: ignore[return-value]
        result = None
        filename = code.co_filename
        if filename in self.watched:
            name = self.watched[filename].get(code.co_firstlineno)
            label = f"{Path(filename).name}:{code.co_firstlineno} {code.co_name}"
            result = (label, name == code.co_name)
        elif filename.startswith(str(REFERENCE_DIR)):
            result = (f"{Path(filename).name}:{code.co_firstlineno} {code.co_name}", False)
        self._cache[code] = result
        return result

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            hit = self._classify(frame.f_code)
            if hit is not None:
                (self.delegates if hit[1] else self.foreign)[hit[0]] += 1
            caller = frame.f_back
            if caller is not None:
                up = self._classify(caller.f_code)
                if up is not None and up[1]:
                    code = frame.f_code
                    self.python_under_delegates[f"{up[0]} -> {Path(code.co_filename).name}:{code.co_name}"] += 1
        elif event == "c_call":
            hit = self._classify(frame.f_code)
            if hit is not None and hit[1]:
                self.c_calls[f"{hit[0]} -> {type(arg).__name__} {getattr(arg, '__name__', '?')}"] += 1


def run(model: str, plants: set[str], max_tokens: int) -> dict[str, Any]:
    from tools.vllm_run import ACTIVEKV, EngineConfig, VllmEngine, make_prompts

    config = json.loads((Path(model) / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    prompts = make_prompts(PROMPT_LENGTHS, int(config["vocab_size"]), 0)
    engine_config = EngineConfig(model, backend=ACTIVEKV, activekv=EXACT, block_size=BLOCK_SIZE)
    with VllmEngine(engine_config) as engine:
        import vllm
        import vllm.v1.attention.backends.activekv as backend_module

        vllm_root = Path(vllm.__file__).resolve().parent.parent
        watched = {str(vllm_root / f): defs for f, defs in delegate_defs().items()}
        if "frame" in plants:
            # One Python frame planted in the ActiveKV path: a wrapper compiled into the backend module's file.
            namespace: dict[str, Any] = {"_delegate": backend_module.ActiveKVImpl.forward}
            source = "\n" * 999 + "def forward(self, *args, **kwargs):\n    return _delegate(self, *args, **kwargs)\n"
            exec(compile(source, backend_module.__file__, "exec"), namespace)
            backend_module.ActiveKVImpl.forward = namespace["forward"]
        if "reference" in plants:
            sys.path.insert(0, str(REPO))
            __import__("tests.reference.engine")
        profile = FrameProfile(watched)
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            gen = engine.generate(prompts, max_tokens)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
    tel = gen.telemetry or {}
    steps = gen.steps
    imported = sorted({m for m in _IMPORTED if m == REFERENCE_MODULE or m.startswith(REFERENCE_MODULE + ".")})
    loaded = sorted(
        name for name, mod in list(sys.modules.items())
        if str(getattr(mod, "__file__", "") or "").startswith(str(REFERENCE_DIR))
    )
    checks = {
        "build_calls == steps": tel.get("build_calls") == steps,
        "forward_calls == layers x steps": tel.get("forward_calls") == layers * steps,
        "kv_update_calls == layers x steps": tel.get("kv_update_calls") == layers * steps,
        "reference never imported": not imported and not loaded,
        "no ActiveKV Python frame but the delegates": not profile.foreign,
        "no Python frame under a delegate": not profile.python_under_delegates,
        "delegate frames == 1 + 2 x layers per step": sum(profile.delegates.values()) == (1 + 2 * layers) * steps,
    }
    return {
        "plants": sorted(plants),
        "steps_vllm": steps,
        "layers_model": layers,
        "native": {k: tel.get(k) for k in ("build_calls", "forward_calls", "kv_update_calls", "forward_skipped")},
        "reference_imports": sorted(set(imported) | set(loaded)),
        "delegate_frames": dict(sorted(profile.delegates.items())),
        "delegate_frames_per_step": round(sum(profile.delegates.values()) / steps, 3) if steps else None,
        "c_calls_from_delegates": dict(sorted(profile.c_calls.items())),
        "python_frames_under_delegates": dict(sorted(profile.python_under_delegates.items())),
        "foreign_frames": dict(sorted(profile.foreign.items())),
        "checks": checks,
        "ok": all(checks.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.proof", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: a tiny Llama made in a temporary directory)")
    parser.add_argument("--plant", default="", help="control run: comma-separated plants (frame, reference)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the report here")
    args = parser.parse_args(argv)
    plants = {p for p in args.plant.split(",") if p}
    unknown = plants - {"frame", "reference"}
    if unknown:
        parser.error(f"unknown plant(s) {sorted(unknown)}; known: frame, reference")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tools.make_tiny_model import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny"))
        report = run(model, plants, args.max_tokens)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
