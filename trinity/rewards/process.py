"""Rewards that cannot hang a job: the reward function runs in a process of its own, with a deadline.

A Python function that never returns cannot be stopped inside the process that called it (a thread
cannot be killed, SIGALRM only reaches the main thread and C code ignores it until it returns), so each
rank keeps one worker process (`python -m trinity.rewards.process`) that imports the function once
and scores a whole batch per call: the common path costs one pipe round trip per step. A call that runs
past its deadline (`reward.timeout_s` per sample) gets the worker killed; the next call starts a new one.

When a batch call fails (an exception, the deadline, a value that is no list of n) the samples are scored
one at a time to find the failing ones; a value that is no finite number is the failure of its own sample.
`reward.on_error` decides: `fail` raises a UserError with the one line of the first failing sample
(trinity.rewards.loader.sample_problem), `zero` scores those samples 0 and returns their lines.
A UserError of a built-in reward (a sample without a reference answer) is a data problem, not the
function's: it always stops the job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from trinity.errors import UserError

if TYPE_CHECKING:
    from trinity.config.schema import RewardConfig

# The worker's start (Python, trinity, the reward's module: sympy for math_verify) is no reward call: it
# has its own, generous limit.
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RewardResult:
    """One score per sample; `errors` has the line of each sample scored 0 (`reward.on_error: zero`)."""

    scores: list[float]
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Outcome:
    """What one call in the worker gave: `scores` (None where `problems` says what went wrong with a
    sample: "returned nan for"), or `failure`, (what, detail) of a call that gave no scores at all."""

    scores: list[float | None] | None = None
    problems: dict[int, str] = field(default_factory=dict)
    failure: tuple[str, str] | None = None
    shape: str | None = None  # the value was no list of n: what it was


def errors_warning(spec: str, errors: list[str], scored: int, when: str = "this step") -> str:
    """The one warning of a step (`when`) whose failing samples scored 0 (`reward.on_error: zero`)."""
    return (f"warning: reward function {spec} failed on {len(errors)} of {scored} samples {when}, scored 0 "
            f"(reward.on_error: zero); the first: {errors[0]}")


class GuardedReward:
    """The job's reward function (`reward:` section) in a worker process, with `timeout_s` per sample."""

    def __init__(self, reward: RewardConfig):
        self.spec = reward.function
        self.timeout_s = reward.timeout_s
        self.on_error = reward.on_error
        self._load = {"spec": reward.function, "extractor": reward.extractor, "marker": reward.marker,
                      "format_pattern": reward.format_pattern, "sys_path": list(sys.path), "cwd": os.getcwd()}
        self._worker: _Worker | None = self._start()  # a reward that cannot be imported fails at the job's start

    def __call__(self, prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
        return self.score(prompts, responses, answers).scores

    def score(self, prompts: list[str], responses: list[str], answers: list[str | None]) -> RewardResult:
        prompts, responses, answers = list(prompts), list(responses), list(answers)
        n = len(responses)
        if n == 0:
            return RewardResult([])
        batch = self._call(prompts, responses, answers, self.timeout_s * n)
        if batch.scores is not None:
            return self._decide(prompts, responses, batch.scores, {i: (w, "") for i, w in batch.problems.items()})
        if batch.shape is not None and self.on_error == "fail":
            raise UserError(f"reward function {self.spec} must return a list of {n} floats, got {batch.shape}")
        scores, problems = self._one_at_a_time(prompts, responses, answers)
        if not problems and self.on_error == "fail":
            what, detail = batch.failure or ("", "")
            raise UserError(f"reward function {self.spec} failed on a batch of {n} samples (each sample alone "
                            f"succeeds): {what.removesuffix(' on')}{': ' + detail if detail else ''}")
        return self._decide(prompts, responses, scores, problems)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    # ------------------------------------------------------------------ internals

    def _one_at_a_time(self, prompts: list[str], responses: list[str], answers: list[str | None]
                       ) -> tuple[list[float | None], dict[int, tuple[str, str]]]:
        """Each sample's own score, or (what, detail) of its failure; with `fail`, up to the first failure."""
        scores: list[float | None] = [None] * len(responses)
        problems: dict[int, tuple[str, str]] = {}
        for i in range(len(responses)):
            one = self._call([prompts[i]], [responses[i]], [answers[i]], self.timeout_s)
            if one.scores is not None and one.scores[0] is not None:
                scores[i] = one.scores[0]
            elif one.scores is not None:
                problems[i] = (one.problems[0], "")
            elif one.shape is not None:
                problems[i] = ("failed on", f"it must return a list of 1 floats, got {one.shape}")
            else:
                assert one.failure is not None
                problems[i] = one.failure
            if problems and self.on_error == "fail":
                break
        return scores, problems

    def _decide(self, prompts: list[str], responses: list[str], scores: list[float | None],
                problems: dict[int, tuple[str, str]]) -> RewardResult:
        """Scores with the failing samples at 0 (`zero`), or the first failing sample's line raised (`fail`)."""
        from trinity.rewards.loader import sample_problem

        lines = [sample_problem(self.spec, i, prompts[i], responses[i], *problems[i]) for i in sorted(problems)]
        if lines and self.on_error == "fail":
            raise UserError(lines[0])
        return RewardResult([0.0 if s is None else s for s in scores], lines)

    def _call(self, prompts: list[str], responses: list[str], answers: list[str | None], deadline_s: float) -> _Outcome:
        if self._worker is None or not self._worker.alive():
            self._worker = self._start()
        reply = self._worker.request((prompts, responses, answers), deadline_s)
        if reply is None:  # past the deadline: the worker is stuck in the function; the next call starts another
            self.close()
            return _Outcome(failure=(f"took longer than {deadline_s:g} s (reward.timeout_s: {self.timeout_s:g} "
                                     f"per sample) on", ""))
        kind, *rest = reply
        if kind == "scores":
            return _Outcome(scores=rest[0], problems=rest[1])
        if kind == "shape":
            return _Outcome(shape=rest[0])
        if kind == "user_error":
            raise UserError(rest[0])
        return _Outcome(failure=("failed on", rest[0]))  # "raised", or "ended": the worker died

    def _start(self) -> _Worker:
        worker = _Worker.start()
        reply = worker.request(self._load, START_TIMEOUT_S)
        if reply is None or reply[0] != "ready":
            worker.stop()
            raise UserError(reply[1] if reply else
                            f"reward function {self.spec}: its module did not load within {START_TIMEOUT_S:.0f} s")
        return worker


class _Worker:
    """The worker process and its two pipes; killed with its guard (garbage collection or exit)."""

    def __init__(self, proc: subprocess.Popen, send: Connection, recv: Connection):
        self.proc, self.send, self.recv = proc, send, recv
        self._finalizer = weakref.finalize(self, _kill, proc, send, recv)

    @classmethod
    def start(cls) -> _Worker:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trinity.rewards.process", str(to_child_r), str(from_child_w), str(os.getpid())],
                pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL)
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        return cls(proc, Connection(to_child_w, readable=False), Connection(from_child_r, writable=False))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, message: Any, deadline_s: float) -> tuple | None:
        """The worker's reply to `message`; None past `deadline_s`; ("ended", why) when it died."""
        try:
            self.send.send(message)
            if not self.recv.poll(deadline_s):
                return None
            return self.recv.recv()
        except (EOFError, OSError):
            code = self.proc.wait()
            return ("ended", f"the reward process ended (exit code {code}) while scoring")

    def stop(self) -> None:
        self._finalizer()


def _kill(proc: subprocess.Popen, send: Connection, recv: Connection) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    send.close()
    recv.close()


# ---------------------------------------------------------------------- the worker process


def _serve(recv: Connection, send: Connection) -> None:
    """Load the function named by the first message, then answer each batch until the pipe closes."""
    from trinity.rewards.loader import check_scores, load_reward_fn

    load = recv.recv()
    sys.path[:] = load["sys_path"]  # what the rank can import, its tests' additions included
    os.chdir(load["cwd"])
    try:
        fn = load_reward_fn(load["spec"], extractor=load["extractor"], marker=load["marker"],
                            format_pattern=load["format_pattern"])
    except UserError as exc:
        send.send(("load_error", str(exc)))
        return
    except BaseException as exc:  # noqa: BLE001 - anything the user's module does at import
        send.send(("load_error", f"reward function {load['spec']}: cannot import it ({type(exc).__name__}: {exc})"))
        return
    send.send(("ready",))
    while True:
        try:
            prompts, responses, answers = recv.recv()
        except EOFError:
            return
        try:
            value = fn(prompts, responses, answers)
        except UserError as exc:
            send.send(("user_error", str(exc)))
            continue
        except BaseException as exc:  # noqa: BLE001 - sys.exit() in a reward is its failure too
            send.send(("raised", f"{type(exc).__name__}: {exc}"))
            continue
        checked = check_scores(value, len(responses))
        if checked.shape is not None:
            send.send(("shape", checked.shape))
        else:
            send.send(("scores", checked.scores, checked.problems))


def main(argv: list[str]) -> int:
    recv_fd, send_fd, parent = (int(a) for a in argv)
    from trinity.parent_death import arm_parent_death

    arm_parent_death(parent)  # never outlive the rank, kill -9 included
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the group: the rank decides
    _serve(Connection(recv_fd, writable=False), Connection(send_fd, readable=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
