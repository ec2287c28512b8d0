"""The docs a newcomer reads, checked: README.md's Python snippets run, the C++ snippets' `typed<...>` signatures
are the registered schemas', and README's model table is docs/perf.md's.

Every ```python block of README.md and docs/*.md is preceded by a marker, an HTML comment (it may span lines):

    <!-- doc-test: cpu,gpu OLD=>NEW ... -->   run it. "cpu": on the CPU, after the OLD=>NEW text substitutions (small
                                              sizes, "cuda"=>"cpu"), with no CUDA device visible. "gpu": as written,
                                              on a CUDA device (the `gpu` marker; skipped without one). Either or both.
    <!-- doc-test: skip (REASON) -->          not run, and why (e.g. a download).

Each block runs alone (its own imports) in a fresh interpreter, in a temporary directory, with the repository's
`examples` on the path (`from examples.block_model import ...`, as from the repository root)."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                              if f.endswith(".md"))
MODES = {"cpu", "gpu"}


def fenced_blocks(path):
    """(first code line, language, code, marker text or None) of every fenced block of `path`."""
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().split("\n")
    found, start = [], None
    for i, line in enumerate(lines):
        if not line.startswith("```"):
            continue
        if start is None:
            start, lang = i, line[3:].strip()
            continue
        before = "\n".join(lines[:start]).rstrip()
        marker = None
        if before.endswith("-->"):
            comment = before[before.rfind("<!--") + 4:-3].strip()
            if comment.startswith("doc-test:"):
                marker = comment[len("doc-test:"):].strip()
        found.append((start + 2, lang, "\n".join(lines[start + 1:i]) + "\n", marker))
        start = None
    return found


def parse_marker(marker):
    """("skip", reason) or (modes, [(old, new), ...]); raises ValueError for anything else."""
    tokens = marker.split()
    if not tokens:
        raise ValueError("an empty doc-test marker")
    if tokens[0] == "skip":
        if len(tokens) == 1:
            raise ValueError("doc-test: skip needs a reason")
        return "skip", " ".join(tokens[1:])
    modes = set(tokens[0].split(","))
    if not modes or modes - MODES:
        raise ValueError(f"doc-test: modes are cpu and / or gpu, got {tokens[0]!r}")
    subs = []
    for t in tokens[1:]:
        if "=>" not in t:
            raise ValueError(f"doc-test: {t!r} is not a substitution OLD=>NEW")
        subs.append(tuple(t.split("=>", 1)))
    return modes, subs


PYTHON = [(path, line, code, marker) for path in DOCS for line, lang, code, marker in fenced_blocks(path)
          if lang == "python"]


def test_every_python_block_says_how_it_is_tested():
    """A snippet nobody runs goes stale: each one is run on the CPU, the GPU or both, or says why not. Each
    substitution of the CPU run must find its text (a stale one would silently run the full size)."""
    assert PYTHON, "README.md has Python snippets"
    for path, line, code, marker in PYTHON:
        where = f"{path}:{line}"
        assert marker is not None, (f"{where}: precede the block with <!-- doc-test: cpu,gpu ... --> or "
                                    "<!-- doc-test: skip (why) -->")
        modes, subs = parse_marker(marker)
        for old, _ in (subs if modes != "skip" else []):
            assert old in code, f"{where}: the substitution {old!r} finds nothing in the block"


def _cpu_code(code, subs):
    for old, new in subs:
        code = code.replace(old, new)
    return code


def _params():
    cuda = torch.cuda.is_available()
    out = []
    for path, line, code, marker in PYTHON:
        parsed = parse_marker(marker) if marker else ("skip", "")
        if parsed[0] == "skip":
            continue
        modes, subs = parsed
        if "cpu" in modes:
            out.append(pytest.param(_cpu_code(code, subs), True, id=f"{path}:{line}-cpu"))
        if "gpu" in modes:
            out.append(pytest.param(code, False, id=f"{path}:{line}-gpu",
                                    marks=[pytest.mark.gpu, pytest.mark.skipif(not cuda, reason="no CUDA device")]))
    return out


def _package_dir():
    """The directory that holds the fused_ops package this pytest imports (installed, or the in-tree build that
    conftest.py puts on the path)."""
    spec = importlib.util.find_spec("fused_ops")
    assert spec is not None and spec.origin, "fused_ops is not importable: build it first (pip install .)"
    return os.path.dirname(os.path.dirname(spec.origin))


@pytest.mark.parametrize("code, on_cpu", _params())
def test_python_snippet_runs(code, on_cpu, tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # interpreter tests may have set it for this process; the snippets run compiled
    (tmp_path / "path").mkdir()  # `examples` alone on the path, not the repository's other top-level packages
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "path" / "examples")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path / "path"), _package_dir(), env.get("PYTHONPATH")) if p)
    env.update({"CXX": "g++", "CC": "gcc"})  # AOTInductor's build: the platform compiler (README, Deployment)
    if on_cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU run must not touch a GPU
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"the snippet failed:\n{code}\n--- stderr ---\n{r.stderr[-4000:]}"


# ------------------------------------------------------------------------------------------------------------------
# C++: a typed<> signature must be the schema's (a missing argument throws at the first call)

TYPED = re.compile(r'static\s+auto\s+(\w+)\s*=\s*c10::Dispatcher::singleton\(\)\s*\.findSchemaOrThrow\("fused::(\w+)",'
                   r'\s*"(\w*)"\)\s*\.typed<(.*?)>\(\);', re.S)


def _split_top(s):
    """s split at its commas outside <...> and (...)."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += (ch in "<(") - (ch in ">)")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in parts + [cur] if p.strip()]


def _norm(cpp, aliases):
    """A C++ parameter type without const, &, spaces and the at::, c10::, std::, torch:: qualifiers."""
    for name, target in aliases.items():
        cpp = re.sub(rf"\b{name}\b", target, cpp)
    cpp = re.sub(r"\b(at|c10|std|torch)::", "", cpp)
    return re.sub(r"\bconst\b|&|\s", "", cpp)


def _schema_cpp(arg_type, n=None):
    """The normalized C++ spellings typed<> accepts for a schema type (str(torch JitType))."""
    opt = re.fullmatch(r"Optional\[(.+)\]", arg_type)
    if opt:
        return {f"optional<{t}>" for t in _schema_cpp(opt.group(1))}
    lst = re.fullmatch(r"List\[(.+)\]", arg_type)
    if lst:
        return ({f"array<{t},{n}>" for t in _schema_cpp(lst.group(1))} if n else
                {f"ArrayRef<{t}>" for t in _schema_cpp(lst.group(1))} | {"IntArrayRef"})
    return {"Tensor": {"Tensor"}, "bool": {"bool"}, "int": {"int64_t"}, "float": {"double"},
            "str": {"string_view", "string"}}.get(arg_type, {arg_type})


def _typed_snippets():
    for path in DOCS:
        for line, lang, code, _ in fenced_blocks(path):
            if lang in ("cpp", "c++"):
                aliases = dict(re.findall(r"using\s+(\w+)\s*=\s*([^;]+);", code))
                for m in TYPED.finditer(code):
                    yield f"{path}:{line}", code, aliases, m


def typed_problems(code, aliases, m, schema):
    """What in one typed<> snippet (TYPED's match m in code) differs from the op's schema: parameter count and types,
    return type, and the argument count of each `VAR.call(...)`."""
    var, op, _, sig = m.groups()
    ret, _, rest = sig.partition("(")
    params = _split_top(rest[:rest.rindex(")")])
    want = [_schema_cpp(str(a.type), getattr(a, "N", None)) for a in schema.arguments]
    if len(params) != len(want):
        return [f"typed<> of fused::{op} has {len(params)} parameters, the schema {len(want)}: {schema}"]
    problems = [f"parameter {i} ({schema.arguments[i].name}) is {p!r}, want one of {sorted(ok)}"
                for i, (p, ok) in enumerate(zip(params, want)) if _norm(p, aliases) not in ok]
    rets = [_schema_cpp(str(r.type)) for r in schema.returns]
    want_ret = {"void"} if not rets else rets[0] if len(rets) == 1 else {
        "tuple<" + ",".join(sorted(r)[0] for r in rets) + ">"}
    if _norm(ret, aliases) not in want_ret:
        problems.append(f"typed<> returns {ret!r}, the schema {schema.returns}")
    for call in re.finditer(rf"\b{var}\.call\(", code):
        depth, j = 1, call.end()
        while depth:
            depth += (code[j] == "(") - (code[j] == ")")
            j += 1
        args = _split_top(code[call.end():j - 1])
        if len(args) != len(want):
            problems.append(f"{var}.call(...) passes {len(args)} arguments, the schema has {len(want)}")
    return problems


def test_cpp_typed_signatures_are_the_schemas():
    import fused_ops  # noqa: F401  (registers torch.ops.fused.*)

    snippets = list(_typed_snippets())
    assert snippets, "README.md's C++ training snippet calls an op through typed<>"
    for where, code, aliases, m in snippets:
        _, op, overload, _ = m.groups()
        schema = getattr(getattr(torch.ops.fused, op), overload or "default")._schema
        assert not typed_problems(code, aliases, m, schema), f"{where}: {typed_problems(code, aliases, m, schema)}"


# ------------------------------------------------------------------------------------------------------------------
# README's model table is the run of docs/perf.md's model table: one number, two places, the same

#: README's rows -> perf.md's rows (a README cell "a / b" holds both rows' values)
MODEL_ROWS = {
    "prefill, 8192 tokens": ["prefill 8192, ms"],
    "training step, 8192 tokens": ["training step 8192, ms"],
    "decode, batch 1 / 16 (cache 8192)": ["decode batch 1, ms", "decode batch 16, ms"],
    "peak memory, training step 8192, MiB": ["peak memory, training 8192, MiB"],
    "CUDA kernels per layer forward": ["kernels per layer forward (8192)"],
}


def _table(path, header_start):
    """{row label: [cell, ...]} of the table whose header row starts with header_start."""
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().split("\n")
    i = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = {}
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def _numbers(cell):
    """The numbers of a cell as written ("1,982" -> "1982"), parentheticals such as "(+5/fwd)" left out."""
    return [n.replace(",", "") for n in re.findall(r"\d[\d,]*(?:\.\d+)?", re.sub(r"\(.*?\)", "", cell))]


def test_readme_model_table_is_perf_mds():
    readme = _table("README.md", "| phase | fused_ops |")
    perf = _table(os.path.join("docs", "perf.md"), "| CogVLM2-19B layer |")
    assert set(readme) == set(MODEL_ROWS), "a README row without its perf.md row in MODEL_ROWS"
    for label, cells in readme.items():
        for col, cell in enumerate(cells):
            got = _numbers(cell)
            want = [n for row in MODEL_ROWS[label] for n in _numbers(perf[row][col])]
            assert len(got) == len(want), f"README {label!r}, column {col + 1}: {cell!r} against perf.md's {want}"
            for g, w in zip(got, want):
                decimals = len(g.split(".")[1]) if "." in g else 0
                assert float(g) == round(float(w), decimals), f"README {label!r}, column {col + 1}: {g} but perf.md {w}"
