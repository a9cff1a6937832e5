"""The abuse corpus: bad and oversized input that the schema corpus (corpus.py) does not hold.

Generated, not hand-listed:
- every number of four valid scenarios (explicit requests; a synthetic workload with gamma
  arrivals, sessions and shared prefixes; a roofline cost with an inline model and GPU; a trace
  workload) written as each of BAD_NUMBERS (NaN, infinities, booleans, a 5,000-digit integer,
  2**63, a 4,800-bit hex integer);
- every number of a calibration file's entries as each of BAD_JSON, and of a sweep file;
- every input kind (scenario, sweep, the sweep's base scenario, Azure and Mooncake traces,
  calibration) replaced by a FIFO, /dev/zero, a symlink to it, a folder, a file past its size
  cap, nesting 10^5 and 100 deep, an integer past the parsers' digit limit;
- the resource-abuse settings (grid points, rows, lengths, tokens, ids, arrival spans) and every
  bounded command-line option out of its range.

A `resource` case is one that would hang or allocate without its limit: the test runs those
only in a real subprocess, under a wall-clock and a memory ceiling.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.config import MAX_SCENARIO_BYTES
from sim.cost.calibration import MAX_CALIBRATION_BYTES
from sim.sweep.spec import MAX_SWEEP_BYTES
from sim.workload.config import MAX_TRACE_ROWS
from sim.workload.traces import MAX_TRACE_BYTES
from tests.hardening.corpus import AZ_HEAD, AZ_ROWS, BASE, Case, Raw, _copy, _set, to_toml


@dataclass
class AbuseCase(Case):
    resource: bool = False  # would hang or allocate without its limit: subprocess only
    special: dict[str, str] = field(default_factory=dict)  # path -> fifo | dir | devzero | size:N


BAD_NUMBERS = {"nan": "nan", "inf": "inf", "-inf": "-inf", "true": "true", "false": "false",
               "digits5000": "9" * 5000, "2**63": str(2**63), "hex4800bits": "0x" + "f" * 1200}
# (leaf, value) pairs the schema corpus already holds
_KNOWN = {("seed", "nan"), ("seed", "2**63"), ("spec.acceptance.rates.0", "inf")}

SYNTH_WORKLOAD = {"synthetic": {
    "num_requests": 6, "arrival": "gamma", "qps": 50.0, "cv": 2.0,
    "prompt_len": {"kind": "lognormal", "mean": 40.0, "sigma": 0.5, "min": 8, "max": 120},
    "output_len": {"kind": "uniform", "min": 1, "max": 4}, "vocab_size": 500,
    "shared_prefix": {"groups": 2, "prefix_len": 16, "fraction": 0.5},
    "sessions": {"num_turns": 2, "think_ns": 1000}}}
ROOF_COST = {
    "kind": "roofline", "step_base_ns": 4000000, "ns_per_token": 20000, "ns_per_kv_token": 20,
    "host_base_ns": 1500000, "host_ns_per_row": 20000, "host_ns_per_token": 0, "tp": 1,
    "launch_ns": 30000, "bw_efficiency": 0.85, "flops_efficiency": 0.7, "draft_layers": 1,
    "page_size": 0,
    "model": {"num_layers": 4, "hidden": 512, "num_q_heads": 8, "num_kv_heads": 2,
              "head_dim": 64, "intermediate": 1024, "vocab": 1000, "dtype_bytes": 2},
    "gpu": {"mem_bw": 4.8e12, "flops": 9.89e14, "mem_bytes": 141000000000, "link_bw": 4.5e11}}


def trace_workload(path: Path, fmt: str = "azure2023") -> dict[str, Any]:
    return {"trace": {"path": str(path), "format": fmt, "limit": 3, "start": 0,
                      "time_scale": 1.0, "max_prompt_len": 200, "max_output_len": 40,
                      "vocab_size": 32000}}


def scenario_bases(root: Path) -> dict[str, tuple[dict[str, Any], tuple[str, ...]]]:
    """name -> (a valid scenario, the prefix of the leaves to mutate)."""
    synth = {**_copy(BASE), "workload": SYNTH_WORKLOAD}
    roof = {**_copy(BASE), "cost": ROOF_COST}
    trace = {**_copy(BASE), "workload": trace_workload(root / "ok.csv")}
    return {"explicit": (BASE, ()), "synthetic": (synth, ("workload",)),
            "roofline": (roof, ("cost",)), "trace": (trace, ("workload",))}


def numeric_leaves(d: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Every int or float in `d` (list elements included), not booleans."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield from numeric_leaves(v, (*path, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from numeric_leaves(v, (*path, i))
    elif isinstance(d, int | float) and not isinstance(d, bool):
        yield path, d


def _named(path: tuple) -> str:
    """The key a message must name: the leaf's, or its list's."""
    return str(next(p for p in reversed(path) if not isinstance(p, int)))


def _run(root: Path, name: str, data: bytes, mention: str, **kw: Any) -> AbuseCase:
    f, out = root / f"{name}.toml", root / f"{name}.out"
    return AbuseCase(name, ["run", str(f), "--out", str(out)], [str(f), mention], out,
                     {str(f): data}, **kw)


def scenario_value_cases(root: Path) -> Iterator[AbuseCase]:
    for base_name, (base, prefix) in scenario_bases(root).items():
        for path, _ in numeric_leaves(base):
            if path[: len(prefix)] != prefix:
                continue
            dotted = ".".join(str(p) for p in path)
            for vname, token in BAD_NUMBERS.items():
                if (dotted, vname) in _KNOWN:
                    continue
                name = f"{base_name}-{dotted}={vname}"
                data = to_toml(_set(base, path, Raw(token)))
                yield _run(root, _safe(name), data, _named(path))


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_=." else "_" for c in name)


# -- cross-field and resource settings of a scenario -------------------------------------------
def _spec(d: int, tokens: int) -> dict[str, Any]:
    s = _set(BASE, ("spec", "max_draft_len"), d)
    s["spec"]["acceptance"] = {"kind": "rates", "rates": [0.5] * d}
    return _set(s, ("scheduler", "max_num_tokens"), tokens)


def _synth(**kw: Any) -> dict[str, Any]:
    w = _copy(SYNTH_WORKLOAD)
    w["synthetic"].update(kw)
    return {**_copy(BASE), "workload": w}


def _requests(*reqs: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {**_copy(BASE), "workload": {"requests": list(reqs), **top}}


def _rates(mult: list[float]) -> dict[str, Any]:
    return _set(BASE, ("spec", "acceptance"),
                {"kind": "rates", "rates": [0.8, 0.5], "request_multiplier": mult})


def setting_cases(root: Path) -> Iterator[AbuseCase]:
    const = {"kind": "constant", "value": 10_000_000}
    many = [{"arrival_ns": 0, "prompt_len": 10_000_000, "output_len": 1}] * 200
    cases: list[tuple[str, dict[str, Any], str, bool]] = [
        ("width-3-budget-2", _spec(2, 2), "max_num_tokens", False),
        ("width-2-budget-1", _spec(1, 1), "max_num_tokens", False),
        ("width-9-budget-5", _spec(8, 5), "max_num_tokens", False),
        ("multiplier-negative", _rates([-0.5, 1.0]), "request_multiplier", False),
        ("multiplier-rate-above-1", _rates([1.0, 2.0]), "request_multiplier", False),
        ("multiplier-reversed", _rates([1.0, 0.5]), "request_multiplier", False),
        ("qps-1e-300", _synth(qps=1e-300), "qps", True),
        ("qps-1e-9-many", _synth(qps=1e-9, num_requests=10_000), "qps", True),
        ("think-overflow", _set(_synth(), ("workload", "synthetic", "sessions"),
                                {"num_turns": 10_000, "think_ns": 10**15}), "qps", True),
        ("sessions-2e9-tokens",
         _set(_synth(num_requests=2000, prompt_len={"kind": "constant", "value": 10_000}),
              ("workload", "synthetic", "sessions"), {"num_turns": 100, "think_ns": 0}),
         "num_requests", True),
        ("synthetic-1e14-tokens", _synth(num_requests=10_000_000, prompt_len=const,
                                         output_len=const), "num_requests", True),
        ("session-id-2**40", _requests({"arrival_ns": 0, "prompt_len": 4, "output_len": 1,
                                        "session": 2**40}), "session", True),
        ("prefix-group-2**40", _requests({"arrival_ns": 0, "prompt_len": 4, "output_len": 1,
                                          "prefix_group": 2**40}, prefix_len=4),
         "prefix_group", True),
        ("explicit-2e9-tokens", _requests(*many), "requests", True),
        ("prefix-groups-huge", _set(_synth(), ("workload", "synthetic", "shared_prefix"),
                                    {"groups": 10**7, "prefix_len": 10}), "groups", True),
    ]
    for name, d, mention, resource in cases:
        yield _run(root, name, to_toml(d), mention, resource=resource)


# -- input files that are not what they claim: every kind x every shape ------------------------
def _deep_toml(depth: int) -> bytes:
    return b"seed = 1\nbad = " + b"[" * depth + b"1" + b"]" * depth + b"\n"


def _deep_json(depth: int) -> bytes:
    return b'{"attention": [], "bad": ' + b"[" * depth + b"1" + b"]" * depth + b"}\n"


def _toml_digits(n: int) -> bytes:
    return b"seed = " + b"9" * n + b"\n"


SHAPES = ("fifo", "devzero", "symlink-devzero", "dir", "oversized")


def _shape(shape: str, f: Path, cap: int, kind: str) -> tuple[dict[str, bytes], dict[str, str],
                                                              str, str]:
    """(files, specials, the path the message names, what it says) for one shape at `f`."""
    if shape == "devzero":
        return {}, {}, "/dev/zero", "regular file"
    if shape == "symlink-devzero":  # a trace path is resolved, so its message names the target
        named = "/dev/zero" if kind in ("azure", "mooncake") else str(f)
        return {}, {str(f): "link:/dev/zero"}, named, "regular file"
    if shape == "oversized":
        return {}, {str(f): f"size:{cap + 1}"}, str(f), "size"
    return {}, {str(f): shape}, str(f), "regular file"


def input_kind_cases(root: Path) -> Iterator[AbuseCase]:
    ok_sc = to_toml(BASE)
    kinds = {  # kind -> (size cap, extra contents to try)
        "scenario": (MAX_SCENARIO_BYTES, {"deep100000": _deep_toml(100_000),
                                          "deep100": _deep_toml(100),
                                          "digits30000": _toml_digits(30_000)}),
        "sweep": (MAX_SWEEP_BYTES, {"deep100000": _deep_toml(100_000),
                                    "deep100": _deep_toml(100),
                                    "digits30000": _toml_digits(30_000)}),
        "base": (MAX_SCENARIO_BYTES, {"deep100000": _deep_toml(100_000),
                                      "digits30000": _toml_digits(30_000)}),
        "azure": (MAX_TRACE_BYTES, {}),
        "mooncake": (MAX_TRACE_BYTES, {}),
        "calibration": (MAX_CALIBRATION_BYTES, {"deep100000": _deep_json(100_000),
                                                "deep100": _deep_json(100)}),
    }
    for kind, (cap, contents) in kinds.items():
        for shape in (*SHAPES, *contents):
            d = root / f"in-{kind}-{shape}"
            f = d / ("input.json" if kind == "calibration" else "input.toml")
            if shape in contents:
                files, special, named, says = {str(f): contents[shape]}, {}, str(f), ""
                says = "nesting" if shape.startswith("deep1000") else (
                    "bad" if shape.startswith("deep") else "seed")
            else:
                files, special, named, says = _shape(shape, f, cap, kind)
            if shape == "devzero":
                f = Path("/dev/zero")
            mentions = [m for m in (named, says) if m]
            yield _input_case(kind, shape, d, f, files, special, mentions, ok_sc,
                              resource=shape in SHAPES or shape.startswith("deep1000"))


def _input_case(kind: str, shape: str, d: Path, f: Path, files: dict[str, bytes],
                special: dict[str, str], mentions: list[str], ok_sc: bytes,
                resource: bool) -> AbuseCase:
    out = d / "out"
    name = f"input-{kind}-{shape}"
    sc = d / "scenario.toml"
    if kind == "scenario":
        argv = ["run", str(f), "--out", str(out)]
    elif kind in ("sweep", "base"):
        sweep = f if kind == "sweep" else d / "sweep.toml"
        base = f if kind == "base" else sc
        if kind == "base":
            files[str(sweep)] = _sweep_file(base)
        else:
            files[str(sc)] = ok_sc
        argv = ["sweep", str(sweep), "--out", str(out)]
    else:
        wl = {**_copy(BASE), "model": {**BASE["model"], "max_position_embeddings": 4096},
              "limits": {"max_seq_len": 4096}}
        if kind == "calibration":
            wl["cost"] = {"kind": "roofline", "model": "llama-3.1-8b", "calibration": str(f)}
        else:
            fmt = "azure2023" if kind == "azure" else "mooncake"
            wl["workload"] = {"trace": {"path": str(f), "format": fmt}}
        files[str(sc)] = to_toml(wl)
        argv = ["run", str(sc), "--out", str(out)]
    return AbuseCase(name, argv, mentions, out, files, resource=resource, special=special)


def _sweep_file(base: Path, **top: Any) -> bytes:
    d = {"base": str(base), "slo": {"ttft_p99_ms": 500.0, "tpot_p99_ms": 10.0},
         "grid": {"cache.num_blocks": [64, 128]}, **top}
    return to_toml(d)


# -- workload trace rows past their limits ------------------------------------------------------
def _mc_row(n: Any, h: Any = None) -> bytes:
    return json.dumps({"timestamp": 0, "input_length": n, "output_length": 2,
                       "hash_ids": [1] if h is None else h}).encode()


def trace_row_cases(root: Path) -> Iterator[AbuseCase]:
    rows = MAX_TRACE_ROWS + 1
    cases: list[tuple[str, str, bytes, str]] = [
        ("azure-context-1e12", "azure2023",
         AZ_HEAD + b"2023-11-16 18:15:46.6805900,1000000000000,44\n", "ContextTokens"),
        ("azure-generated-1e12", "azure2023",
         AZ_HEAD + b"2023-11-16 18:15:46.6805900,4,1000000000000\n", "GeneratedTokens"),
        ("azure-digits5000", "azure2023",
         AZ_HEAD + b"2023-11-16 18:15:46.6805900," + b"9" * 5000 + b",4\n", "ContextTokens"),
        ("azure-rows", "azure2023", AZ_HEAD + b"x\n" * rows, "rows"),
        ("azure-tokens", "azure2023",
         AZ_HEAD + b"".join(b"2023-11-16 18:15:46,9000000,9000000\n" for _ in range(120)),
         "tokens"),
        ("mooncake-context-1e12", "mooncake", _mc_row(10**12, []), "input_length"),
        ("mooncake-digits5000", "mooncake", _mc_row(0).replace(b"0,", b"9" * 5000 + b",", 1),
         "timestamp"),
        ("mooncake-digits30000", "mooncake",
         _mc_row(1).replace(b'"input_length": 1', b'"input_length": ' + b"9" * 30000),
         "line 1"),
        ("mooncake-deep", "mooncake", b'{"timestamp": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
         "line 1"),
        ("mooncake-rows", "mooncake", b"x\n" * rows, "rows"),
        ("mooncake-hash-ids-huge", "mooncake", _mc_row(4, [2**70]), "hash_ids"),
    ]
    for name, fmt, data, mention in cases:
        d = root / name
        t, sc = d / "trace", d / "scenario.toml"
        wl = {**_copy(BASE), "model": {**BASE["model"], "max_position_embeddings": 4096},
              "limits": {"max_seq_len": 4096}, "workload": {"trace": {"path": str(t),
                                                                       "format": fmt}}}
        yield AbuseCase(name, ["run", str(sc), "--out", str(d / "out")], [str(t), mention],
                        d / "out", {str(t): data, str(sc): to_toml(wl)}, resource=True)


# -- calibration files --------------------------------------------------------------------------
CAL_OK = {"meta": {"gpu": "test"},
          "attention": [{"kind": "decode", "batch": 1, "kv_len": 128, "q_len": 1,
                         "page_size": 16, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                         "us": 10.5}],
          "gemm": [{"m": 16, "n": 4096, "k": 4096, "us": 20.0}]}
BAD_JSON = {"NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity", "1e999": "1e999",
            "true": "true", "null": "null", "string": '"7"', "zero": "0", "negative": "-3",
            "digits5000": "9" * 5000}


def _json_with(d: dict[str, Any], path: tuple, token: str) -> bytes:
    marker = "@@MARK@@"
    return json.dumps(_set(d, path, marker)).replace(f'"{marker}"', token).encode()


def calibration_cases(root: Path) -> Iterator[AbuseCase]:
    edits = [(path, _named(path)) for path, _ in numeric_leaves(CAL_OK)]
    for path, named in edits:
        for vname, token in BAD_JSON.items():
            name = _safe(f"calibration-{'.'.join(map(str, path))}={vname}")
            yield _cal_case(root, name, _json_with(CAL_OK, path, token), named)
    for name, data, named in (
            ("calibration-meta-list", json.dumps({**CAL_OK, "meta": [1]}).encode(), "meta"),
            ("calibration-top-list", b"[1, 2]", "attention"),
            ("calibration-axis-1000", json.dumps({**CAL_OK, "attention": [
                {**CAL_OK["attention"][0], "batch": b + 1} for b in range(1000)]}).encode(),
             "batch")):
        yield _cal_case(root, name, data, named, resource=name.endswith("1000"))


def _cal_case(root: Path, name: str, data: bytes, named: str,
              resource: bool = False) -> AbuseCase:
    d = root / name
    cal, sc = d / "cal.json", d / "scenario.toml"
    s = {**_copy(BASE), "cost": {"kind": "roofline", "model": "llama-3.1-8b",
                                 "calibration": str(cal)}}
    return AbuseCase(name, ["run", str(sc), "--out", str(d / "out")], [str(cal), named],
                     d / "out", {str(cal): data, str(sc): to_toml(s)}, resource=resource)


# -- sweep files ----------------------------------------------------------------------------------
SWEEP_OK = {"slo": {"ttft_p99_ms": 500.0, "tpot_p99_ms": 10.0},
            "search": {"param": "workload.synthetic.qps", "lo": 1.0, "hi": 64.0, "iters": 3}}


def sweep_cases(root: Path) -> Iterator[AbuseCase]:
    base = root / "sweep-base.toml"
    base_data = to_toml({**_copy(BASE), "workload": SYNTH_WORKLOAD})
    ok = {"base": str(base), **_copy(SWEEP_OK), "grid": {"cache.num_blocks": [64, 128]}}
    for path, _ in numeric_leaves(ok):
        dotted = ".".join(map(str, path))
        for vname, token in BAD_NUMBERS.items():
            name = _safe(f"sweep-{dotted}={vname}")
            # a grid value is checked as the base scenario's field, once the file parsed
            in_base = path[0] == "grid" and not vname.startswith(("digits", "hex"))
            named = "num_blocks" if path[0] == "grid" else _named(path)
            yield _sweep_case(root, name, to_toml(_set(ok, path, Raw(token))), named, base,
                              base_data, in_base)
    grid10 = {f"cache.k{i}": list(range(10)) for i in range(10)}
    for name, d, named, resource in (
            ("sweep-grid-1e10-points", {**ok, "grid": grid10}, "grid", True),
            ("sweep-grid-key-deep", {**ok, "grid": {"a." * 100 + "b": [1]}}, "dotted", True),
            ("sweep-search-hi-1e300", _set(ok, ("search", "hi"), 1e300), "hi", False),
            ("sweep-slo-negative", _set(ok, ("slo", "ttft_p99_ms"), -5.0), "ttft_p99_ms",
             False)):
        yield _sweep_case(root, name, to_toml(d), named, base, base_data, False, resource)


def _sweep_case(root: Path, name: str, data: bytes, named: str, base: Path, base_data: bytes,
                in_base: bool, resource: bool = False) -> AbuseCase:
    f, out = root / f"{name}.toml", root / f"{name}.out"
    return AbuseCase(name, ["sweep", str(f), "--out", str(out)],
                     [str(base) if in_base else str(f), named], out,
                     {str(f): data, str(base): base_data}, resource=resource)


# -- command-line options -------------------------------------------------------------------------
def flag_cases(root: Path) -> Iterator[AbuseCase]:
    sc, sweep, base = root / "flags.toml", root / "flags-sweep.toml", root / "flags-base.toml"
    files = {str(sc): to_toml(BASE), str(base): to_toml({**_copy(BASE),
                                                         "workload": SYNTH_WORKLOAD}),
             str(sweep): _sweep_file(base)}
    missing = str(root / "no-such-trace")
    out = root / "flags.out"
    fuzz = ["fuzz", "--profile", "vllm-v1", "--out", str(out), "--db", str(root / "db")]
    argvs: list[tuple[list[str], str, bool]] = [
        *[(["run", str(sc), "--out", str(out), "--seed", v], "--seed", False)
          for v in ("-1", str(-(2**63)), str(2**63))],
        (["run", str(sc), "--out", str(out), "--max-violations", "-1"], "--max-violations",
         False),
        *[([*fuzz, "--budget", v], "--budget", v in ("inf", "1e9", "86401"))
          for v in ("inf", "nan", "-inf", "0", "-1", "1e9", "86401")],
        *[([*fuzz, "--workers", v], "--workers", v != "-1")
          for v in ("1000000", "-1", "257")],
        ([*fuzz, "--seed", "-1"], "--seed", False),
        *[(["sweep", str(sweep), "--out", str(out), "--workers", v], "--workers", v != "-1")
          for v in ("1000000", "-1", "257")],
        *[(["metrics", missing, "--slo", f"{metric}:p99={v}"], "--slo", False)
          for metric in ("ttft", "tpot")
          for v in ("nan", "inf", "-inf", "-1", "0", "1e10")],
        (["check", missing, "--limit", "-1"], "--limit", False),
        *[(["replay", missing, "--tol", v], "--tol", False) for v in ("nan", "inf", "-1")],
    ]
    for i, (argv, flag, resource) in enumerate(argvs):
        name = _safe(f"flag-{argv[0]}{flag}={argv[-1]}-{i}")
        yield AbuseCase(name, argv, [flag], out, dict(files), resource=resource)


def all_cases(root: Path) -> list[AbuseCase]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "ok.csv").write_bytes(AZ_HEAD + b"\n".join(AZ_ROWS) + b"\n")
    return [*scenario_value_cases(root), *setting_cases(root), *input_kind_cases(root),
            *trace_row_cases(root), *calibration_cases(root), *sweep_cases(root),
            *flag_cases(root)]


def materialise(case: AbuseCase) -> None:
    """Write the case's files and make its special paths (FIFO, folder, sparse file, link)."""
    if case.out is not None:
        case.out.parent.mkdir(parents=True, exist_ok=True)
    for f, data in case.files.items():
        Path(f).parent.mkdir(parents=True, exist_ok=True)
        Path(f).write_bytes(data)
    for f, kind in case.special.items():
        p = Path(f)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists() or p.is_symlink():
            continue
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "dir":
            p.mkdir()
        elif kind.startswith("link:"):
            p.symlink_to(kind.removeprefix("link:"))
        else:  # size:N, sparse: the size is refused before a byte is read
            with open(p, "wb") as fh:
                fh.truncate(int(kind.removeprefix("size:")))
