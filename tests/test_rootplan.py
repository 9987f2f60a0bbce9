"""What a slot's layered root hides: root-only host files, except where the slot sees an
empty directory anyway (a whiteout there used to break every shell start)."""

import os

from hermes_modal_tool.agent import rootplan
from hermes_modal_tool.drivers import _rootmask


def test_paths_under_emptied_directories_need_no_whiteout(tmp_path):
    hidden = rootplan.hidden_paths(
        [], ["/var/tmp/build/work/work", "/tmp/x", "/root/.ssh", "/etc/shadow", "/var/tmp"],
        nonstandard_top=False)
    assert hidden == (["/etc/shadow"] if os.path.lexists("/etc/shadow") else [])


def test_under_empty_dir_names_the_directory_and_below_only():
    assert rootplan.under_empty_dir("/var/tmp")
    assert rootplan.under_empty_dir("/var/tmp/a/b")
    assert not rootplan.under_empty_dir("/var/tmpfoo")
    assert not rootplan.under_empty_dir("/var/cache/x")


def test_scan_does_not_enter_an_emptied_directory(tmp_path, monkeypatch):
    tree = tmp_path / "var"
    (tree / "tmp" / "job").mkdir(parents=True)
    (tree / "cache").mkdir()
    for path in (tree / "tmp" / "job" / "secret", tree / "cache" / "secret"):
        path.write_text("x")
        path.chmod(0o600)
    monkeypatch.setattr(rootplan, "EMPTY_DIRS", {str(tree / "tmp"): 0o1777})
    found = _rootmask._scan((str(tree),))
    assert found == [str(tree / "cache" / "secret")]
