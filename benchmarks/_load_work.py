"""The work of ``load.py``: what each step of a trajectory runs and exactly what it must
return (``step_calls``), and the check of every result against it (``Tally``: ok, lost,
misrouted, wrong; see ``load.py``'s docstring for what each means).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from hermes_modal_tool import ExecutionResult


@dataclass
class Call:
    """One tool call and exactly what it must return."""

    tool: str
    args: dict[str, Any]
    output: str
    success: bool = True
    returncode: int | None = 0
    timed_out: bool = False
    kind: str = ""


def step_calls(t: int, s: int, idx: int, seed: int, timeout_every: int) -> list[Call]:
    """The calls of step ``s`` of trajectory ``t`` (whose slot has index ``idx``)."""
    tag = f"T{t} S{s}"
    host = f"slot-{idx}"
    if s == 0:
        return [Call("bash", {"command": f"echo T{t} > .owner; export TRAJ=T{t}; echo {tag} $HOSTNAME"},
                     f"{tag} {host}\n", kind="init")]
    rng = random.Random(f"{seed}:{t}:{s}")
    r = rng.random()
    if timeout_every and rng.randrange(timeout_every) == 0:
        return [Call("bash", {"command": f"echo {tag} begin; sleep 5; echo {tag} never", "timeout": 1},
                     f"{tag} begin\n", success=False, returncode=124, timed_out=True, kind="timeout")]
    if r < 0.45:
        cmd = f'read -r o < .owner; echo "{tag} $o $TRAJ $HOSTNAME $(({t} * {s}))"'
        return [Call("bash", {"command": cmd}, f"{tag} T{t} T{t} {host} {t * s}\n", kind="builtin")]
    if r < 0.70:
        cmd = (f"python3 -c 'import os, socket; print(\"{tag}\", open(\".owner\").read().strip(), "
               "os.environ[\"TRAJ\"], os.getcwd(), socket.gethostname())'")
        return [Call("bash", {"command": cmd}, f"{tag} T{t} T{t} /data/slot_{idx} {host}\n",
                     kind="process")]
    if r < 0.96:
        payload = rng.randbytes(rng.randrange(8, 400)).hex()
        content = f"{tag} {payload}\n"
        name = f"s{s}.txt"
        return [Call("write_file", {"path": name, "content": content},
                     f"wrote {len(content)} bytes to /data/slot_{idx}/{name}", kind="write"),
                Call("bash", {"command": f"cat {name}; echo $TRAJ $HOSTNAME"},
                     f"{content}T{t} {host}\n", kind="cat")]
    return [Call("bash", {"command": f"echo {tag} fail $TRAJ; (exit 3)"}, f"{tag} fail T{t}\n",
                 success=False, returncode=3, kind="fail")]


@dataclass
class Tally:
    ok: int = 0
    lost: int = 0
    misrouted: int = 0
    wrong: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    samples: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    agent_s: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)

    def check(self, t: int, s: int, call: Call, r: Any) -> None:
        self.by_kind[call.kind] = self.by_kind.get(call.kind, 0) + 1
        problem = None
        if not isinstance(r, ExecutionResult):
            self.lost += 1
            problem = f"lost: {r!r:.200}"
        else:
            if r.metadata.get("duration_s") is not None:
                self.agent_s.append(r.metadata["duration_s"])
            if _names_other(r.output, t, s, call.output):
                self.misrouted += 1
                problem = "misrouted"
            elif call.success and not r.success:
                self.lost += 1
                problem = "lost (failed)"
            elif not _matches(call, r):
                self.wrong += 1
                problem = "wrong"
        if problem is not None:
            why = (r.error or f"output differs ({call.kind})") if isinstance(r, ExecutionResult) else "exception"
            why = why.split(";")[0][:70]
            if "timed out after" in why:
                why = f"{call.kind}: " + why
            key = f"{problem.split(' ')[0]}: {why}"
            self.reasons[key] = self.reasons.get(key, 0) + 1
        if problem is None:
            self.ok += 1
        elif len(self.samples) < 10:
            got = (r.success, r.output[:200], r.error, r.metadata) if isinstance(r, ExecutionResult) else r
            self.samples.append(f"{problem}: T{t} S{s} {call.kind} want {call.output[:120]!r} got {got!r}")


def _matches(call: Call, r: ExecutionResult) -> bool:
    if r.success != call.success:
        return False
    if call.tool == "write_file":
        return r.output == call.output
    if call.timed_out:
        # what it printed before the timeout, then at most bash's note on the killed
        # foreground job ("Terminated"), never what it would have printed after
        if not r.output.startswith(call.output) or "never" in r.output:
            return False
    elif r.output != call.output:
        return False
    if r.metadata.get("returncode") != call.returncode:
        return False
    return bool(r.metadata.get("timed_out")) == call.timed_out


def _names_other(output: str, t: int, s: int, expected: str) -> bool:
    """Whether an output names another trajectory, step or slot than the expected one."""
    words = output.replace("\n", " ").split(" ")
    hosts = {w for w in expected.replace("\n", " ").split(" ") if w.startswith(("slot-", "/data/slot_"))}
    for i, w in enumerate(words):
        if w.startswith(("slot-", "/data/slot_")) and w not in hosts:
            return True
        if len(w) > 1 and w[0] == "T" and w[1:].isdigit() and w != f"T{t}":
            return True
        if (len(w) > 1 and w[0] == "S" and w[1:].isdigit() and i and words[i - 1].startswith("T")
                and w != f"S{s}"):
            return True
    return False
