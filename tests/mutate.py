"""Mutation testing of the modules that carry the contract, each against its own fast test subset (mutmut 3).

    .venv/bin/python tests/mutate.py                 # every module below
    .venv/bin/python tests/mutate.py deployments/auth.py model/preview.py
    .venv/bin/python tests/mutate.py --list          # the modules and their test subsets

Each module runs in a copy of the checkout (git's tracked and untracked files) under a temporary folder, so runs of
different modules never share mutmut's `mutants/` state and the checkout stays clean. For each module it writes
`<out>/<module>.json`: mutmut's counts and, for every mutant that survived, its name and diff, for triage in the
report (`bench/results/mutation-<date>.md`). Not part of CI: a full run takes hours on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# module -> the tests that exercise it quickly (pytest node ids or files). mutmut runs, for each mutant, only the
# tests of this list that called the mutated function.
MODULES: dict[str, list[str]] = {
    "deployments/schema.py": ["tests/test_schema.py"],
    "deployments/auth.py": ["tests/test_auth.py"],
    "deployments/playground.py": ["tests/test_playground.py"],
    "model/prompt_cache.py": ["tests/test_prompt_cache.py"],
    "deployments/adapters.py": ["tests/test_adapters.py"],
    "model/adapters.py": ["tests/test_adapters.py", "tests/test_adapter_slots.py"],
    "model/adapter_slots.py": ["tests/test_adapter_slots.py"],
    "model/family.py": ["tests/test_kontext.py", "tests/test_family.py"],
    "deployments/files.py": ["tests/test_files.py"],
    "deployments/engine.py": ["tests/test_engine.py", "tests/test_compile.py"],
    "deployments/replica.py": ["tests/test_replica.py", "tests/test_engine.py"],
    "model/png.py": ["tests/test_png.py"],
    "model/preview.py": ["tests/test_preview.py",
                         "tests/test_pipeline.py::test_previews_leave_the_image_unchanged_and_come_after_their_steps",
                         "tests/test_pipeline.py::test_preview_steps_spread_and_bounds",
                         "tests/test_pipeline.py::test_preview_map_recovers_colours_of_a_picture_it_was_not_fitted_on"],
    "model/tiers.py": ["tests/test_tiers.py"],
    "model/execution.py": ["tests/test_fp8.py", "tests/test_graphs.py", "tests/test_tiers.py"],
    "model/pipeline.py": ["tests/test_edits.py", "tests/test_lora.py", "tests/test_preview.py", "tests/test_pipeline.py"],
    "kernels/fp8.py": ["tests/test_fp8.py", "tests/test_kernel_calls.py"],
    "kernels/residual.py": ["tests/test_kernels.py", "tests/test_kernels_gpu.py", "tests/test_lora_tail.py"],
    # The kernels' CUDA branches run only on a GPU host (FLUXSERVE_MUTATE_GPU=1, the GPU tests included).
    "kernels/modulate.py": ["tests/test_guards.py", "tests/test_kernel_calls.py", "tests/test_kernels.py",
                            "tests/test_flux_lossless.py",
                            "tests/test_tiers.py",
                            "tests/test_fp8.py", "tests/test_kernels_gpu.py", "tests/test_pipeline_gpu.py"],
    "kernels/rope.py": ["tests/test_guards.py", "tests/test_kernel_calls.py", "tests/test_kernels.py",
                        "tests/test_flux_lossless.py",
                        "tests/test_attention.py",
                        "tests/test_kernels_gpu.py", "tests/test_pipeline_gpu.py"],
    "kernels/gelu.py": ["tests/test_guards.py", "tests/test_kernel_calls.py", "tests/test_kernels.py", "tests/test_tiers.py", "tests/test_flux.py", "tests/test_kernels_gpu.py",
                        "tests/test_pipeline_gpu.py"],
    # tests/test_tp.py runs the layers in spawned ranks, out of reach; test_linear.py runs them in threads
    "model/linear.py": ["tests/test_linear.py", "tests/test_family.py", "tests/test_fp8.py",
                        "tests/test_adapter_slots.py"],  # (the layer's adapter side path and its parts)
    "model/features.py": ["tests/test_features.py", "tests/test_tiers.py"],
    "model/peft_tail.py": ["tests/test_lora_tail.py"],
    "model/vae.py": ["tests/test_vae.py"],
    "kernels/groupnorm.py": ["tests/test_vae.py"],
    "kernels/lora.py": ["tests/test_lora_tail.py", "tests/test_kernel_calls.py"],
    "kernels/sites.py": ["tests/test_sites.py", "tests/test_tiers.py"],
}

# Lines no test should pin: log calls (their wording is for people) and type-checking-only imports.
IGNORED_LINES = [r"^\s*logger\.(debug|info|warning|exception)\(", r"^\s*logging\.getLogger"]


def _copy_checkout(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())


def _config(modules: list[str], tests: list[str]) -> str:
    packages = sorted({m.split("/")[0] for m in modules})
    others = sorted(({m.split("/")[0] for m in MODULES} | {"model", "kernels", "tp", "deployments"}) - set(packages))

    def lines(values: list[str]) -> str:
        return "".join(f"\n    {v}" for v in values)

    return ("[mutmut]\n"
            f"source_paths={lines(packages)}\n"
            f"only_mutate={lines(modules)}\n"
            # torch.compile cannot trace mutmut's trampolines: compiled tests fail in its stats run, so they are out
            f"pytest_add_cli_args_test_selection={lines([*tests, '-k', os.environ.get('FLUXSERVE_MUTATE_K', 'not compile')])}\n"
            "pytest_add_cli_args=\n    -p\n    no:cacheprovider\n    -q\n"
            f"also_copy={lines([*others, 'README.md'])}\n"  # (tests/test_features.py reads its table)
            f"do_not_mutate_patterns={lines(IGNORED_LINES)}\n"
            # torch and Ray are not safe to fork after their setup: workers fork from a server that only imported
            "process_isolation=forkserver\n"
            # On a GPU host the warm-up's test collection would initialise CUDA in the server its workers fork from
            + ("forkserver_warmup=none\n" if os.environ.get("FLUXSERVE_MUTATE_GPU") else ""))


def _counts(statuses: list[str]) -> dict[str, int]:
    counts = {"total": len(statuses)}
    for status in statuses:
        key = status.replace(" ", "_")
        counts[key] = counts.get(key, 0) + 1
    return counts


def run_modules(modules: list[str], out: Path, mutmut: str, only: list[str] | None = None,
                tests: list[str] | None = None, max_children: int | None = None,
                seconds: float | None = None) -> list[dict]:
    """Mutate `modules` in one mutmut run (one copy, one stats run over the union of their test subsets, or `tests`),
    then write one JSON per module. After `seconds` mutmut is stopped and the mutants it checked are reported."""
    t0 = time.time()
    tests = tests or list(dict.fromkeys(t for m in modules for t in MODULES[m]))
    name = modules[0].replace("/", ".") + (f"+{len(modules) - 1}" if len(modules) > 1 else "")
    with tempfile.TemporaryDirectory(prefix="fluxserve-mutate-") as tmp:
        work = Path(tmp)
        _copy_checkout(work)
        # mutmut reads [tool.mutmut] from pyproject.toml before setup.cfg: keep the copy's pyproject free of it
        (work / "setup.cfg").write_text(_config(modules, tests))
        with open(out / (name + ".log"), "w") as fh:
            run = subprocess.Popen([mutmut, "run", *(["--max-children", str(max_children)] if max_children else []),
                                    *(only or [])], cwd=work, stdout=fh, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, start_new_session=True)
            try:
                run.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                os.killpg(run.pid, signal.SIGTERM)  # its workers too; what they finished is on disk
                run.wait()
                fh.write(f"\nstopped after {seconds} s\n")
        listed = subprocess.run([mutmut, "results", "--all", "true"], cwd=work, capture_output=True,
                                text=True).stdout
        statuses: dict[str, list[tuple[str, str]]] = {m: [] for m in modules}
        for line in listed.splitlines():
            mutant, _, status = line.strip().rpartition(": ")
            owner = next((m for m in modules if mutant.startswith(m[:-3].replace("/", ".") + ".")), None)
            if owner is not None and status != "not checked":
                statuses[owner].append((mutant, status))
        results = []
        for module in modules:
            survivors = []
            for mutant, status in statuses[module]:
                if status == "killed":
                    continue
                diff = subprocess.run([mutmut, "show", mutant], cwd=work, capture_output=True, text=True).stdout
                survivors.append({"name": mutant, "status": status,
                                  "diff": [d for d in diff.splitlines()
                                           if d[:1] in "+-" and not d.startswith(("+++", "---"))]})
            result = {"module": module, "tests": tests, "seconds": round(time.time() - t0),
                      **_counts([s for _, s in statuses[module]]), "not_killed": survivors,
                      # every checked mutant's status, so runs of one module (CPU, GPU) can be merged by name
                      "statuses": dict(statuses[module])}
            if not statuses[module]:
                result["error"] = f"no mutant checked; see {name}.log"
            (out / (module.replace("/", ".") + ".json")).write_text(json.dumps(result, indent=1))
            results.append(result)
    return results


def merged(folders: list[Path]) -> dict[str, dict]:
    """Per module, the union of several runs' JSONs (e.g. a CPU run and a GPU run of the CUDA-only functions): a
    mutant counts as killed when any run killed it. Runs without per-mutant statuses contribute their survivors only."""
    modules: dict[str, dict] = {}
    for folder in folders:
        for f in sorted(folder.glob("*.json")):
            r = json.loads(f.read_text())
            m = modules.setdefault(r["module"], {"statuses": {}, "diffs": {}})
            for name, status in r.get("statuses", {}).items():
                if m["statuses"].get(name) != "killed":
                    m["statuses"][name] = status
            for s in r["not_killed"]:
                m["diffs"][s["name"]] = s["diff"]
                m["statuses"].setdefault(s["name"], s["status"])
    for m in modules.values():
        m["not_killed"] = [{"name": n, "status": s, "diff": m["diffs"].get(n, [])}
                           for n, s in sorted(m["statuses"].items()) if s != "killed"]
        m.update(_counts(list(m["statuses"].values())))
    return modules


def report(out: Path) -> str:
    """A markdown table of the per-module JSONs in `out`, then every mutant that was not killed, by module."""
    rows, details = [], []
    for f in sorted(out.glob("*.json")):
        r = json.loads(f.read_text())
        missed = r["not_killed"]
        rows.append(f"| `{r['module']}` | {r.get('total', 0)} | {r.get('killed', 0)} | {r.get('timeout', 0)} | "
                    f"{len(missed)} | {' '.join(r['tests'])} | {r['seconds']} |")
        if missed:
            details.append(f"\n### `{r['module']}`\n")
            for m in missed:
                diff = "\n".join(m["diff"])
                details.append(f"- `{m['name'].rsplit('.', 1)[-1]}` ({m['status']})\n\n  ```diff\n  "
                               + diff.replace("\n", "\n  ") + "\n  ```")
    head = ("| module | mutants | killed | timed out | not killed | tests | seconds |\n"
            "| --- | --- | --- | --- | --- | --- | --- |")
    return "\n".join([head, *rows, *details]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="*", help="modules to mutate (default: all of MODULES)")
    ap.add_argument("--out", default=str(ROOT / "out" / "mutation"), help="folder for the per-module JSON and logs")
    ap.add_argument("--list", action="store_true", help="print the modules and their test subsets")
    ap.add_argument("--report", action="store_true", help="print a markdown report of the JSONs in --out")
    ap.add_argument("--merge", nargs="+", default=None, metavar="FOLDER",
                    help="print, per module, the union of the runs in these folders (killed in any run: killed)")
    ap.add_argument("--together", action="store_true",
                    help="mutate the given modules in one run (one stats run; the GPU host's way to save time)")
    ap.add_argument("--tests", nargs="+", default=None, help="test files or ids instead of the modules' subsets")
    ap.add_argument("--max-children", type=int, default=None, help="mutants tested at once (mutmut's default: cores)")
    ap.add_argument("--seconds", type=float, default=None, help="stop mutmut after this long and report what it checked")
    ap.add_argument("--only", nargs="+", default=None, metavar="GLOB",
                    help="mutant names to run (mutmut's fnmatch patterns, e.g. 'kernels.fp8.x_scaled_mm*'); others "
                         "are left unchecked and out of the JSON")
    a = ap.parse_args(argv)
    if a.report:
        print(report(Path(a.out)), end="")
        return 0
    if a.merge:
        for module, m in sorted(merged([Path(f) for f in a.merge]).items()):
            print(f"{module}: {m.get('killed', 0)}/{m['total']} killed; not killed: "
                  + (", ".join(f"{x['name'].rsplit('.', 1)[-1]} ({x['status']})" for x in m["not_killed"]) or "none"))
        return 0
    if a.list:
        for module, tests in MODULES.items():
            print(f"{module}: {' '.join(tests)}")
        return 0
    unknown = [m for m in a.modules if m not in MODULES]
    if unknown:
        ap.error(f"unknown module(s) {unknown}; known: {sorted(MODULES)}")
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or shutil.which("mutmut")
    if mutmut is None:
        ap.error("mutmut is not installed: pip install -e '.[test]'")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    modules = a.modules or list(MODULES)
    for group in ([modules] if a.together else [[m] for m in modules]):
        for r in run_modules(group, out, mutmut, a.only, a.tests, a.max_children, a.seconds):
            print(f"{r['module']}: {r.get('killed', 0)}/{r.get('total', 0)} killed, {len(r['not_killed'])} not killed, "
                  f"{r['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
