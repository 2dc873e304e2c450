"""contracts.toml and ``tools.contracts``: every rule holds for the series, and each rule catches its breach (CLI).

The rules are documented in ``tools/contracts.py``; the negative tests copy the patch directory to ``tmp_path``, break
one thing, and run ``python -m tools.contracts check`` on the copy.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # a bare `pytest`: the dev-side tools live at the repository root
    sys.path.insert(0, str(REPO))

from tools import vllm_tree  # noqa: E402
from tools import contracts  # noqa: E402
from tools.vllm_patch import DEFAULT_PATCHES, Series  # noqa: E402

CONTRACTS = DEFAULT_PATCHES / "contracts.toml"
NEW_MODULE = "vllm/v1/attention/backends/activekv.py"
PATCH_0002 = "0002-activekv-add-the-ActiveKV-attention-backend-module.patch"
LAUNCHER = Path(sys.executable).parent / "activekv"

# The check's patched side is made by the native launcher (tools.vllm_patch.materialize).
pytestmark = pytest.mark.skipif(not LAUNCHER.is_file(), reason=f"no {LAUNCHER}: run `make build`")


@pytest.fixture(scope="module")
def ref() -> Path:
    return vllm_tree.reference_tree()


@pytest.fixture(scope="module")
def report(ref: Path) -> contracts.Report:
    return contracts.check(ref, Series.load(DEFAULT_PATCHES), CONTRACTS)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.contracts", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def problems(report: contracts.Report, rule: str) -> list[str]:
    return [p for p in report.problems if p.startswith(f"{rule}:")]


# ------------------------------------------------------------------------------------------------ the series holds


def test_check_cli_passes_on_the_series(ref: Path) -> None:
    done = cli("check", "--vllm-src", str(ref))
    assert done.returncode == 0, done.stdout + done.stderr
    # README's spelling, without --vllm-src: the same reference tree, as tools.census takes it
    bare = cli("check")
    assert bare.returncode == 0 and bare.stdout == done.stdout, bare.stdout + bare.stderr
    assert re.fullmatch(
        r"OK: (\d+) contracts cover the \1 added Python lines of 5 patches; every one is framework-contract\n",
        done.stdout,
    )


def test_check_cli_passes_against_a_patched_tree(ref: Path, tmp_path: Path) -> None:
    site = vllm_tree.copy_as_installed(tmp_path / "site")
    applied = subprocess.run([str(LAUNCHER), "patch", "apply", "--vllm", str(site), "--patches",
                              str(DEFAULT_PATCHES)], capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    done = cli("check", "--vllm-src", str(site))
    assert done.returncode == 0, done.stdout + done.stderr


def test_schema_parses(report: contracts.Report) -> None:
    assert problems(report, "schema") == []
    data = tomllib.loads(CONTRACTS.read_text())
    assert data["schema"] == 1
    assert data["vllm"] == "0.32.0"
    assert len(data["contract"]) == len(report.contracts) > 0


def test_every_added_line_has_one_entry_and_every_entry_an_added_line(report: contracts.Report) -> None:
    assert problems(report, "coverage") == []
    assert len(report.pairs) == len(report.added) == len(report.contracts)
    assert all(c.line == a.text and c.patch == a.patch and c.file == a.file for c, a in report.pairs)
    assert {a.file for a in report.added} == {
        "vllm/v1/attention/backends/registry.py",
        NEW_MODULE,
        "vllm/platforms/cpu.py",
        "vllm/v1/metrics/activekv.py",
        "vllm/v1/worker/utils.py",
    }


def test_every_kind_is_framework_contract(report: contracts.Report) -> None:
    assert problems(report, "kind") == []
    assert {c.kind for c in report.contracts} == {"framework-contract"}


def test_every_citation_quotes_the_reference_tree(report: contracts.Report, ref: Path) -> None:
    assert problems(report, "citation") == []
    for c in report.contracts:
        assert (ref / c.cites.file).read_text().splitlines()[c.cites.line - 1].strip() == c.cites.text, c.label()


def test_every_cited_line_names_the_symbol_of_its_added_line(report: contracts.Report) -> None:
    assert problems(report, "symbol") == []
    assert problems(report, "statement") == []


def test_new_module_lines_are_one_line_delegations(report: contracts.Report) -> None:
    assert problems(report, "delegation") == []
    statements = [a for _, a in report.pairs if a.file == NEW_MODULE]
    calls = [a.text for a in statements if "_backend." in a.text or "self._native." in a.text]
    assert all(not a.text.startswith(("if ", "for ", "while ", "try", "with ")) for a in statements)
    assert len(calls) == 21  # 0002: supports_compute_capability delegates too


def test_routing_lines_mirror_vllm_and_imports_resolve(report: contracts.Report) -> None:
    assert problems(report, "routing") == []
    assert problems(report, "imports") == []
    assert report.problems == []


def test_list_cli_prints_every_added_line_with_its_kind(ref: Path, report: contracts.Report) -> None:
    done = cli("list", "--vllm-src", str(ref))
    assert done.returncode == 0
    rows = [line.split("\t") for line in done.stdout.splitlines() if "\t" in line]
    assert [r[3] for r in rows] == [a.text for a in report.added]
    assert {r[2] for r in rows} == {"framework-contract"}


# ------------------------------------------------------------------------------------------- each breach is caught


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    """A copy of the patch directory to break."""
    return Path(shutil.copytree(DEFAULT_PATCHES, tmp_path / "patches"))


def entries(text: str) -> list[str]:
    head, *blocks = text.split("\n[[contract]]\n")
    return [head, *blocks]


def join(parts: list[str]) -> str:
    return "\n[[contract]]\n".join(parts)


def edit_entry(path: Path, line: str, old: str, new: str, occurrence: int = 0) -> None:
    """Replace ``old`` by ``new`` in the ``occurrence``-th entry whose line is ``line``."""
    parts = entries(path.read_text())
    hits = [i for i, b in enumerate(parts) if f"line = {line!r}".replace("'", '"') in b]
    index = hits[occurrence]
    assert old in parts[index]
    parts[index] = parts[index].replace(old, new, 1)
    path.write_text(join(parts))


def check_broken(ref: Path, patches: Path) -> subprocess.CompletedProcess[str]:
    done = cli("check", "--vllm-src", str(ref), "--patches", str(patches))
    assert done.returncode == 1, done.stdout
    assert done.stdout.splitlines()[-1].startswith("FAIL: ")
    return done


def test_a_line_with_no_entry_is_reported(ref: Path, broken: Path) -> None:
    path = broken / "contracts.toml"
    parts = entries(path.read_text())
    parts = [b for b in parts if 'line = "return _backend.supports_sink()"' not in b]
    path.write_text(join(parts))
    done = check_broken(ref, broken)
    assert (
        f"coverage: {PATCH_0002} {NEW_MODULE}:58 ('return _backend.supports_sink()') has no [[contract]] entry"
        in done.stdout
    )


def test_an_entry_with_no_line_is_reported(ref: Path, broken: Path) -> None:
    path = broken / "contracts.toml"
    edit_entry(path, "return _backend.name()", 'line = "return _backend.name()"', 'line = "return _backend.title()"')
    done = check_broken(ref, broken)
    assert "coverage: contract #13 (vllm/v1/attention/backends/activekv.py: 'return _backend.title()')" in done.stdout
    assert "matches no added line" in done.stdout
    assert "('return _backend.name()') has no [[contract]] entry" in done.stdout


def test_a_stale_citation_line_number_is_reported(ref: Path, broken: Path) -> None:
    edit_entry(broken / "contracts.toml", "return ActiveKVImpl", "line = 419\n", "line = 418\n")
    done = check_broken(ref, broken)
    assert "citation: contract #16" in done.stdout
    assert "stale citation vllm/model_executor/layers/attention/attention.py:418" in done.stdout
    assert "the quoted text is at line 419" in done.stdout


def test_a_stale_citation_text_is_reported(ref: Path, broken: Path) -> None:
    edit_entry(broken / "contracts.toml", "if invalid_reasons:", 'text = "if invalid_reasons:"', 'text = "if reasons:"')
    done = check_broken(ref, broken)
    assert "citation: contract #" in done.stdout
    assert "reads 'if invalid_reasons:', contracts.toml quotes 'if reasons:'" in done.stdout


def test_a_citation_past_the_end_or_of_a_missing_file_is_reported(ref: Path, broken: Path) -> None:
    path = broken / "contracts.toml"
    edit_entry(path, "return ActiveKVImpl", "line = 419\n", "line = 99999\n")
    edit_entry(path, "return ActiveKVMetadataBuilder", 'file = "vllm/v1/worker/utils.py"', 'file = "vllm/nope.py"')
    done = check_broken(ref, broken)
    assert "past its end" in done.stdout
    assert "cites vllm/nope.py, which the reference tree does not have" in done.stdout


@pytest.mark.parametrize("kind", ["delegation", "convenience", "async-protocol"])
def test_a_kind_other_than_framework_contract_is_reported(ref: Path, broken: Path, kind: str) -> None:
    edit_entry(broken / "contracts.toml", "return ActiveKVImpl", 'kind = "framework-contract"', f'kind = "{kind}"')
    done = check_broken(ref, broken)
    assert f"kind: contract #16 (vllm/v1/attention/backends/activekv.py: 'return ActiveKVImpl') is '{kind}'" in (
        done.stdout
    )


def test_an_unknown_kind_or_missing_key_is_a_schema_error(ref: Path, broken: Path) -> None:
    path = broken / "contracts.toml"
    edit_entry(path, "return ActiveKVImpl", 'kind = "framework-contract"', 'kind = "glue"')
    edit_entry(path, "return ActiveKVMetadataBuilder", "why = ", "reason = ")
    done = check_broken(ref, broken)
    assert "schema: contract #16: kind 'glue' is not one of" in done.stdout
    assert "schema: contract #19: missing key 'why'" in done.stdout
    assert "schema: contract #19: unknown key 'reason'" in done.stdout


def test_a_citation_naming_another_symbol_is_reported(ref: Path, broken: Path) -> None:
    # def get_name(): cited to the declaration of get_impl_cls (a valid quote, but of another method).
    path = broken / "contracts.toml"
    edit_entry(path, "def get_name():", "line = 80\n", "line = 85\n")
    cited = 'text = "def get_impl_cls() -> type[\\"AttentionImplBase\\"]:"'
    edit_entry(path, "def get_name():", 'text = "def get_name() -> str:"', cited)
    done = check_broken(ref, broken)
    assert "symbol: contract #12 (vllm/v1/attention/backends/activekv.py: 'def get_name():')" in done.stdout
    assert "names none of the line's key symbols ['get_name']" in done.stdout


def test_a_native_import_in_an_existing_module_must_cite_vllms_import_of_it(ref: Path, broken: Path) -> None:
    # 0005's import in vllm/v1/worker/utils.py (the series' third native import) cited to the plugin loader: a
    # valid quote, and a `load`, but that call loads ActiveKV's entry point, not the module the import lands in.
    path = broken / "contracts.toml"
    line = "from activekv import _backend"
    edit_entry(path, line, 'file = "vllm/v1/worker/gpu_model_runner.py"', 'file = "vllm/plugins/__init__.py"', 2)
    edit_entry(path, line, "line = 219\n", "line = 69\n", 2)
    edit_entry(path, line, 'text = "from vllm.v1.worker.utils import ("', 'text = "func = plugin.load()"', 2)
    done = check_broken(ref, broken)
    assert "symbol: contract #83 (vllm/v1/worker/utils.py: 'from activekv import _backend')" in done.stdout
    assert "must cite vLLM's import of that module ('from vllm.v1.worker.utils import ...')" in done.stdout
    assert len(done.stdout.splitlines()) == 2, done.stdout


def test_a_decorator_cited_to_another_methods_decorator_is_reported(ref: Path, broken: Path) -> None:
    path = broken / "contracts.toml"
    edit_entry(path, "@staticmethod", "line = 78\n", "line = 83\n", occurrence=0)
    done = check_broken(ref, broken)
    assert "symbol: contract #11" in done.stdout
    assert "the cited decorator does not decorate a get_name method" in done.stdout


def test_logic_in_the_new_module_is_reported(ref: Path, broken: Path) -> None:
    # Same number of lines (the hunk header stays valid), but the delegate now computes in Python.
    patch = broken / PATCH_0002
    patch.write_text(
        patch.read_text().replace(
            "+        return _backend.supported_head_sizes()\n", "+        return _backend.supported_head_sizes()[:4]\n"
        )
    )
    edit_entry(
        broken / "contracts.toml",
        "return _backend.supported_head_sizes()",
        'line = "return _backend.supported_head_sizes()"',
        'line = "return _backend.supported_head_sizes()[:4]"',
    )
    done = check_broken(ref, broken)
    assert "delegation: contract #25" in done.stdout
    assert "not a one-line call into _backend/self._native" in done.stdout
    assert len([t for t in done.stdout.splitlines() if t.startswith("delegation:")]) == 1


def test_an_if_in_the_new_module_is_reported(ref: Path, broken: Path) -> None:
    patch = broken / PATCH_0002
    patch.write_text(
        patch.read_text().replace(
            "+        return _backend.supports_sink()\n", "+        if _backend.supports_sink(): return True\n"
        )
    )
    edit_entry(
        broken / "contracts.toml",
        "return _backend.supports_sink()",
        'line = "return _backend.supports_sink()"',
        'line = "if _backend.supports_sink(): return True"',
    )
    done = check_broken(ref, broken)
    assert "delegation: contract #37" in done.stdout
    assert "'if' statement: logic in Python" in done.stdout


def test_an_import_of_a_missing_vllm_name_is_reported(ref: Path, broken: Path) -> None:
    patch = broken / PATCH_0002
    old = "+from vllm.v1.attention.backend import AttentionImpl\n"
    patch.write_text(patch.read_text().replace(old, "+from vllm.v1.attention.backend import AttentionImplX\n"))
    edit_entry(
        broken / "contracts.toml",
        "from vllm.v1.attention.backend import AttentionImpl",
        'line = "from vllm.v1.attention.backend import AttentionImpl"',
        'line = "from vllm.v1.attention.backend import AttentionImplX"',
    )
    done = check_broken(ref, broken)
    assert "imports: contract #4" in done.stdout
    assert "vllm.v1.attention.backend defines no AttentionImplX in the reference tree" in done.stdout


def test_a_routing_line_citing_another_statement_type_is_reported(ref: Path, broken: Path) -> None:
    # `if invalid_reasons:` cited to vLLM's `invalid_reasons = backend_class.validate_configuration(` (an assignment).
    path = broken / "contracts.toml"
    edit_entry(path, "if invalid_reasons:", "line = 440\n", "line = 431\n")
    edit_entry(
        path,
        "if invalid_reasons:",
        'text = "if invalid_reasons:"',
        'text = "invalid_reasons = backend_class.validate_configuration("',
    )
    done = check_broken(ref, broken)
    assert "routing: contract #" in done.stdout
    assert "statement type 'if' differs from the cited vLLM line's ('assign')" in done.stdout


def test_symbol_extraction_follows_the_documented_rule() -> None:
    source = (
        "from activekv import _backend\n"
        "from vllm.v1.attention.backend import AttentionBackend\n"
        "class B(AttentionBackend):\n"
        "    flag = False\n"
        "    @classmethod\n"
        "    def supports_sink(cls):\n"
        "        return _backend.supports_sink()\n"
        "    def __init__(self, *args):\n"
        "        self._native = _backend.Impl(*args)\n"
        "        self.scale = self._native.scale\n"
        "def route(x):\n"
        "    if x == E.ACTIVEKV:\n"
        "        raise ValueError(x)\n"
        "    return E.ACTIVEKV.get_path()\n"
    )
    infos = contracts.line_infos(source)
    assert {n: infos[n].symbols for n in sorted(infos)} == {
        1: {"import_module", "load"},
        2: {"AttentionBackend"},
        3: {"AttentionBackend"},
        4: {"flag", "B"},
        5: {"classmethod"},
        6: {"supports_sink"},
        7: {"supports_sink"},
        8: {"__init__"},
        9: {"__init__"},
        10: {"scale"},
        11: {"route"},
        12: {"x", "E", "ACTIVEKV"},
        13: {"ValueError"},
        14: {"route", "get_path"},
    }
    assert [contracts.delegation_problem(infos[n]) is None for n in (4, 7, 9, 10, 12, 13, 14)] == [
        True,
        True,
        True,
        True,
        False,
        False,
        False,
    ]
