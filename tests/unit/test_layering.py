"""Import rules (STYLE.md): arrows point forward; kv/sched are pure; the simulator never imports
torch; gpu_backend depends on the trace format, never on the scheduler's internals."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports(folder: str) -> dict[str, set[str]]:
    out = {}
    for f in (ROOT / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        out[str(f.relative_to(ROOT))] = names
    return out


def test_kv_and_sched_are_pure_synchronous_python():
    for folder in ("sim/kv", "sim/sched"):
        for f, names in imports(folder).items():
            bad = {n for n in names if n.split(".")[0] in ("simpy", "torch", "flashinfer")}
            assert not bad, f"{f} imports {bad}"


def test_kv_does_not_depend_on_later_stages():
    for f, names in imports("sim/kv").items():
        later = {n for n in names if n.startswith(("sim.sched", "sim.executor", "sim.engine",
                                                   "sim.check", "sim.api"))}
        assert not later, f"{f} imports {later}"


def test_simpy_only_where_time_lives():
    for f, names in imports("sim").items():
        if "simpy" in names:
            assert f == "sim/engine.py", f"{f} imports simpy"


def test_gpu_backend_never_reaches_into_the_scheduler():
    for f, names in imports("gpu_backend").items():
        bad = {n for n in names if n.startswith(("sim.sched", "sim.kv", "sim.engine",
                                                 "sim.executor"))}
        assert not bad, f"{f} imports {bad}"


def test_running_the_simulator_never_imports_torch():
    code = ("import sys, sim.api, sim.cli, sim.check; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_gpu_tests_collect_where_triton_and_flashinfer_are_missing():
    # CI's torch is the CPU build, without Triton: a GPU test module that imports a Triton
    # module at its top breaks the whole run instead of skipping.
    code = (
        "import sys, pytest\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('triton', 'flashinfer'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests/gpu']))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]


def test_the_vllm_driver_imports_only_the_stdlib_vllm_and_torch():
    """sim/engines/vllm_driver.py runs inside .venv-vllm, where kvsim is not installed: any
    other import would fail there (and would pull kvsim's pins into vLLM's environment)."""
    names = imports("sim/engines")["sim/engines/vllm_driver.py"]
    bad = {n for n in names if n.split(".")[0] not in
           (*sys.stdlib_module_names, "__future__", "vllm", "torch")}
    assert not bad, f"sim/engines/vllm_driver.py imports {bad}"


def _gpu_backend_modules() -> dict[str, Path]:
    return {".".join(f.relative_to(ROOT).with_suffix("").parts): f
            for f in (ROOT / "gpu_backend").rglob("*.py")}


def _runtime_imports(f: Path, known: set[str]) -> set[str]:
    """The gpu_backend modules f imports when it runs (at its top or inside a function), not
    the ones it names for type checking only (`if TYPE_CHECKING:`)."""
    tree = ast.parse(f.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        for a in node.names:  # `from gpu_backend.host import layout` names a module
            full = f"{node.module}.{a.name}"
            out.add(full if full in known else node.module)
    return {m for m in out if m in known}


def test_gpu_backend_has_no_import_cycles() -> None:
    mods = _gpu_backend_modules()
    edges = {m: _runtime_imports(f, set(mods)) for m, f in mods.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges[m]):
            assert state.get(n) != 1, "import cycle: " + " -> ".join(path[path.index(n):] + [n]
                                                                     if n in path else path + [n])
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])


def test_gpu_backend_is_a_few_small_modules() -> None:
    """At most 25 modules (an __init__ counts only if it holds code), none over 400 lines, no
    function over ~60 (62: the fp32 reference's Triton kernel, whole)."""
    code = {}
    for m, f in _gpu_backend_modules().items():
        body = ast.parse(f.read_text()).body
        if f.name != "__init__.py" or any(not isinstance(n, ast.Expr) for n in body):
            code[m] = f
    assert len(code) <= 25, sorted(code)
    for m, f in code.items():
        text = f.read_text()
        assert len(text.splitlines()) <= 400, m
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno < 62, f"{m}.{node.name}"


def test_the_cpu_backend_imports_no_gpu_module() -> None:
    """`--backend reference` loads no Triton, numba or FlashInfer module, and no module of
    their twins (`*_triton`, `*_jit`) or the CUDA graphs."""
    code = ("import sys, torch\n"
            "before = set(sys.modules)\n"
            "import gpu_backend.replay.cpu\n"
            "new = set(sys.modules) - before\n"
            "bad = sorted(m for m in new if m.split('.')[0] in ('triton', 'numba', 'flashinfer')"
            " or m.endswith(('_jit', '_triton', '.graphs')))\n"
            "assert 'gpu_backend.replay.cpu' in new and not bad, bad\n"
            "print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
