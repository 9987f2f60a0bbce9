"""Write examples/coding_rollouts.jsonl: 64 scripted coding rollouts for ``hermes-modal-tool batch``.

Each rollout is what an agent fixing a bug does in its own slot: write a small
Python project (a module with a buggy function and a stdlib ``unittest`` file),
run the tests (they fail), read the code, write the fix, run the tests again
(they pass). Eight tasks times eight scenarios; each scenario adds steps that
exercise one part of the engine (``cd``/``export`` persistence, a timeout, a
missing file, a non-zero exit, artifacts, stdin/env, append and background jobs).
Every expectation is written so that a correct engine meets all of them and a broken
step cannot: an expectation on a command's output gives its exit code too, and every
test run says how many tests must run (``tests_ran``), so a run from the wrong
directory (0 tests: ``OK`` on Python 3.11, exit 5 on 3.12+) is a mismatch. The file
passes ``hermes-modal-tool batch --strict``, which refuses anything looser.

Paths: a slot starts in its workspace (``/data/slot_N``, the ``workspace_dir`` of
:class:`~hermes_modal_tool.Slot`); the project is ``proj/`` there. ``$HOME`` is the
slot's ``/root`` (a slot is a whole machine), so no step uses ``~``.

Usage:
    python examples/make_coding_rollouts.py [OUT.jsonl]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from textwrap import dedent

# name -> (module, buggy source, fixed source, test source)
TASKS: dict[str, tuple[str, str, str, str]] = {
    "fizzbuzz": ("fizzbuzz", """
        def fizzbuzz(n):
            if n % 3 == 0:
                return "Fizz"
            if n % 5 == 0:
                return "Buzz"
            if n % 15 == 0:
                return "FizzBuzz"
            return str(n)
        """, """
        def fizzbuzz(n):
            if n % 15 == 0:
                return "FizzBuzz"
            if n % 3 == 0:
                return "Fizz"
            if n % 5 == 0:
                return "Buzz"
            return str(n)
        """, """
        import unittest

        from fizzbuzz import fizzbuzz


        class FizzBuzzTest(unittest.TestCase):
            def test_plain(self):
                self.assertEqual(fizzbuzz(7), "7")

            def test_fizz_buzz(self):
                self.assertEqual(fizzbuzz(9), "Fizz")
                self.assertEqual(fizzbuzz(10), "Buzz")

            def test_fizzbuzz(self):
                self.assertEqual(fizzbuzz(30), "FizzBuzz")
        """),
    "palindrome": ("text_utils", """
        def is_palindrome(text):
            return text == text[::-1]
        """, """
        def is_palindrome(text):
            letters = [c.lower() for c in text if c.isalnum()]
            return letters == letters[::-1]
        """, """
        import unittest

        from text_utils import is_palindrome


        class PalindromeTest(unittest.TestCase):
            def test_simple(self):
                self.assertTrue(is_palindrome("level"))
                self.assertFalse(is_palindrome("python"))

            def test_case_and_punctuation(self):
                self.assertTrue(is_palindrome("A man, a plan, a canal: Panama"))
        """),
    "binary_search": ("search", """
        def binary_search(items, target):
            lo, hi = 0, len(items) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if items[mid] == target:
                    return mid
                if items[mid] < target:
                    lo = mid + 1
                else:
                    hi = mid - 1
            return -1
        """, """
        def binary_search(items, target):
            lo, hi = 0, len(items) - 1
            while lo <= hi:
                mid = (lo + hi) // 2
                if items[mid] == target:
                    return mid
                if items[mid] < target:
                    lo = mid + 1
                else:
                    hi = mid - 1
            return -1
        """, """
        import unittest

        from search import binary_search


        class BinarySearchTest(unittest.TestCase):
            def test_found(self):
                self.assertEqual(binary_search([1, 3, 5, 7, 9], 3), 1)

            def test_ends(self):
                self.assertEqual(binary_search([1, 3, 5, 7], 7), 3)
                self.assertEqual(binary_search([4], 4), 0)

            def test_missing(self):
                self.assertEqual(binary_search([1, 3, 5], 4), -1)
                self.assertEqual(binary_search([], 1), -1)
        """),
    "word_count": ("words", """
        def word_count(text):
            counts = {}
            for word in text.split(" "):
                counts[word] = counts.get(word, 0) + 1
            return counts
        """, """
        def word_count(text):
            counts = {}
            for word in text.lower().split():
                counts[word] = counts.get(word, 0) + 1
            return counts
        """, """
        import unittest

        from words import word_count


        class WordCountTest(unittest.TestCase):
            def test_one_line(self):
                self.assertEqual(word_count("a b a"), {"a": 2, "b": 1})

            def test_whitespace_and_case(self):
                self.assertEqual(word_count("The cat  the\\nhat"), {"the": 2, "cat": 1, "hat": 1})
        """),
    "merge_intervals": ("intervals", """
        def merge(intervals):
            merged = []
            for start, end in intervals:
                if merged and start <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], end))
                else:
                    merged.append((start, end))
            return merged
        """, """
        def merge(intervals):
            merged = []
            for start, end in sorted(intervals):
                if merged and start <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], end))
                else:
                    merged.append((start, end))
            return merged
        """, """
        import unittest

        from intervals import merge


        class MergeTest(unittest.TestCase):
            def test_sorted_input(self):
                self.assertEqual(merge([(1, 3), (2, 6), (8, 10)]), [(1, 6), (8, 10)])

            def test_unsorted_input(self):
                self.assertEqual(merge([(8, 10), (1, 3), (2, 6)]), [(1, 6), (8, 10)])
        """),
    "roman": ("roman", """
        VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


        def roman_to_int(numeral):
            return sum(VALUES[c] for c in numeral)
        """, """
        VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


        def roman_to_int(numeral):
            total = 0
            for i, c in enumerate(numeral):
                value = VALUES[c]
                if i + 1 < len(numeral) and VALUES[numeral[i + 1]] > value:
                    total -= value
                else:
                    total += value
            return total
        """, """
        import unittest

        from roman import roman_to_int


        class RomanTest(unittest.TestCase):
            def test_additive(self):
                self.assertEqual(roman_to_int("III"), 3)
                self.assertEqual(roman_to_int("LVIII"), 58)

            def test_subtractive(self):
                self.assertEqual(roman_to_int("IV"), 4)
                self.assertEqual(roman_to_int("MCMXCIV"), 1994)
        """),
    "flatten": ("nested", """
        def flatten(items):
            out = []
            for item in items:
                if isinstance(item, list):
                    out.extend(item)
                else:
                    out.append(item)
            return out
        """, """
        def flatten(items):
            out = []
            for item in items:
                if isinstance(item, list):
                    out.extend(flatten(item))
                else:
                    out.append(item)
            return out
        """, """
        import unittest

        from nested import flatten


        class FlattenTest(unittest.TestCase):
            def test_flat(self):
                self.assertEqual(flatten([1, 2, 3]), [1, 2, 3])

            def test_deep(self):
                self.assertEqual(flatten([1, [2, [3, [4]]], 5]), [1, 2, 3, 4, 5])
        """),
    "median": ("stats", """
        def median(values):
            ordered = sorted(values)
            return ordered[len(ordered) // 2]
        """, """
        def median(values):
            ordered = sorted(values)
            mid = len(ordered) // 2
            if len(ordered) % 2:
                return ordered[mid]
            return (ordered[mid - 1] + ordered[mid]) / 2
        """, """
        import unittest

        from stats import median


        class MedianTest(unittest.TestCase):
            def test_odd(self):
                self.assertEqual(median([3, 1, 2]), 2)

            def test_even(self):
                self.assertEqual(median([4, 1, 3, 2]), 2.5)
        """),
}

# name -> an extra check appended to the tests in the append_background scenario.
REGRESSIONS = {
    "fizzbuzz": 'fizzbuzz(45) == "FizzBuzz"',
    "palindrome": 'is_palindrome("No lemon, no melon")',
    "binary_search": "binary_search(list(range(0, 100, 2)), 98) == 49",
    "word_count": 'word_count("Go go GO") == {"go": 3}',
    "merge_intervals": "merge([(5, 6), (1, 2), (2, 5)]) == [(1, 6)]",
    "roman": 'roman_to_int("XLIX") == 49',
    "flatten": "flatten([[[[]]], [1]]) == [1]",
    "median": "median([10, 0]) == 5",
}

SCENARIOS = ("plain", "cd_export", "timeout", "missing_file", "nonzero_exit", "artifacts",
             "stdin_env", "append_background")


def bash(command: str, **expect: object) -> dict:
    call: dict = {"tool": "bash", "args": {"command": command}}
    if expect:
        call["expect"] = expect
    return call


def src(text: str) -> str:
    return dedent(text).lstrip("\n")


def rollout(task: str, scenario: str) -> dict:
    """One trajectory: the task's bug-fixing loop plus the scenario's extra steps."""
    module, buggy, fixed, tests = TASKS[task]
    n_tests = tests.count("def test_")
    calls: list[dict] = [
        {"tool": "write_file", "args": {"path": f"proj/{module}.py", "content": src(buggy)}},
        {"tool": "write_file", "args": {"path": f"proj/test_{module}.py", "content": src(tests)}},
        # The tests fail on the buggy code; `cd proj` persists for the next calls.
        bash("cd proj && python3 -m unittest -q", returncode=1, output_contains="FAILED", tests_ran=n_tests),
        {"tool": "read_file", "args": {"path": f"proj/{module}.py"},
         "expect": {"success": True, "output_contains": "def "}},
    ]
    if scenario == "cd_export":
        # The shell is in the workspace's proj/; remember it in an exported variable,
        # leave, and come back through the variable (both must persist between calls).
        calls += [bash(f"export TASK_NAME={task} PROJ=$PWD && cd /tmp", returncode=0),
                  bash('echo "$PWD $TASK_NAME"', returncode=0, output_matches=f"^/tmp {task}$"),
                  bash('cd "$PROJ" && pwd', returncode=0, output_matches=r"^/data/slot_\d+/proj$")]
    elif scenario == "missing_file":
        calls += [{"tool": "read_file", "args": {"path": "proj/NOTES.md"}, "expect": {"success": False}},
                  {"tool": "list_files", "args": {"path": "proj"},
                   "expect": {"success": True, "output_contains": f"test_{module}.py"}}]
    elif scenario == "nonzero_exit":
        calls += [bash("python3 -c 'import sys; sys.exit(3)'", returncode=3, success=False),
                  bash("sh -c 'exit 42'", returncode=42),
                  bash("false", returncode=1, success=False),
                  bash("grep -q NO_SUCH_TEXT *.py", returncode=1)]
    calls += [
        {"tool": "write_file", "args": {"path": f"proj/{module}.py", "content": src(fixed)}},
        # No `cd` here: the shell is still in proj from the first test run.
        bash("python3 -m unittest -q", returncode=0, output_matches=r"^OK$", tests_ran=n_tests),
    ]
    if scenario == "timeout":
        calls += [{"tool": "bash", "args": {"command": "sleep 30", "timeout": 1},
                   "expect": {"timed_out": True, "returncode": 124, "success": False}},
                  # The slot survives the timeout: same directory, shell still usable.
                  bash("python3 -m unittest -q && pwd", returncode=0, output_matches=r"^/data/slot_\d+/proj$",
                       tests_ran=n_tests)]
    elif scenario == "artifacts":
        calls += [{"tool": "list_artifacts", "args": {"path": "proj", "recursive": True},
                   "expect": {"success": True, "output_contains": f"{module}.py"}},
                  {"tool": "read_artifact", "args": {"path": f"proj/{module}.py", "include_sha256": True},
                   "expect": {"success": True, "output_contains": "def "}},
                  {"tool": "archive_artifacts", "args": {"path": "proj"}, "expect": {"success": True}}]
    elif scenario == "stdin_env":
        calls += [{"tool": "bash", "args": {"command": "python3 -c 'import sys; print(sys.stdin.read().upper())'",
                                            "stdin": f"{task} fixed\n"},
                   "expect": {"returncode": 0, "output_contains": f"{task.upper()} FIXED"}},
                  {"tool": "bash", "args": {"command": 'echo "reviewer=$REVIEWER"', "env": {"REVIEWER": task}},
                   "expect": {"returncode": 0, "output_matches": f"^reviewer={task}$"}}]
    elif scenario == "append_background":
        extra = ("\n\nclass RegressionTest(unittest.TestCase):\n"
                 "    def test_regression(self):\n"
                 f"        self.assertTrue({REGRESSIONS[task]})\n")
        calls += [{"tool": "write_file", "args": {"path": f"proj/test_{module}.py", "content": extra, "append": True},
                   "expect": {"success": True, "output_contains": "appended"}},
                  # The pipe's status is tail's: the test run's own exit code is checked too.
                  bash('python3 -m unittest -v 2>&1 | tail -n 3; test "${PIPESTATUS[0]}" = 0', returncode=0,
                       tests_ran=n_tests + 1),
                  bash("python3 -m unittest -q", returncode=0, output_matches=r"^OK$", tests_ran=n_tests + 1),
                  {"tool": "bash", "args": {"command": "sleep 60", "background": True},
                   "expect": {"returncode": 0, "success": True, "output_contains": "background job"}}]
    return {"id": f"{task}-{scenario}", "meta": {"task": task, "scenario": scenario}, "calls": calls}


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).with_name("coding_rollouts.jsonl")
    rows = [rollout(task, scenario) for task in TASKS for scenario in SCENARIOS]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {len(rows)} trajectories ({sum(len(r['calls']) for r in rows)} calls) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
