"""minipaged/boot.py: what is settled before anything loads. Here, the Numba cache's folder:
named after every kernel source, so that an edit of any of them (one a kernel only inlines,
say) compiles afresh instead of running stale machine code; a user's NUMBA_CACHE_DIR wins."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from minipaged.boot import kernel_cache_dir


def test_the_cache_folder_follows_every_kernel_source(tmp_path):
    kernels, home = tmp_path / "kernels", tmp_path / "home"
    kernels.mkdir()
    (kernels / "cpu.py").write_text("from .simd import load\n")
    (kernels / "simd.py").write_text("def load(): return 1\n")
    first = kernel_cache_dir(kernels, home)
    assert first.is_dir() and first.parent == home / "numba"
    assert kernel_cache_dir(kernels, home) == first                  # nothing changed: the same cache
    (kernels / "simd.py").write_text("def load(): return 2\n")       # only the inlined file changed
    second = kernel_cache_dir(kernels, home)
    assert second != first
    (kernels / "notes.txt").write_text("not a kernel")
    assert kernel_cache_dir(kernels, home) == second                  # only the Python sources count


def test_old_cache_folders_are_pruned_to_the_newest(tmp_path):
    kernels, home = tmp_path / "kernels", tmp_path / "home"
    kernels.mkdir()
    made = []
    for version in range(6):
        (kernels / "cpu.py").write_text(f"VERSION = {version}\n")
        made.append(kernel_cache_dir(kernels, home, keep=3))
        (made[-1] / "index.nbi").write_bytes(b"x")                   # a cached kernel in it
        time.sleep(0.01)                                              # distinct modification times
    assert sorted(p.name for p in (home / "numba").iterdir()) == sorted(p.name for p in made[-3:])


def test_a_fresh_process_caches_under_the_digest_and_a_users_choice_wins(tmp_path):
    code = "import minipaged, os; print(os.environ['NUMBA_CACHE_DIR'])"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["MINIPAGED_HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith(str(tmp_path / "numba") + os.sep)
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "mine")
