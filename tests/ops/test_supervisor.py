"""The supervisor of server.workers around its forks, with real processes: a stop that comes
between two forks, or to a worker before its own handlers are set, and the descriptors a
worker keeps. Each supervisor runs in a process (and session) of its own, so that one that
hangs fails the test, its workers killed with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

TIMEOUT_S = 30.0


def supervised(script: str) -> subprocess.CompletedProcess[str]:
    """Run `script` (it calls supervise) in a session of its own; fail if it is not done
    within TIMEOUT_S, after killing the whole session."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"the supervisor did not exit within {TIMEOUT_S:g} s; stderr:\n{stderr}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def test_a_stop_between_two_forks_stops_every_worker() -> None:
    done = supervised(
        """
        import contextlib, signal, sys
        from kvguard.ops import logs, workers

        logs.configure("info")
        around_fork = logs.writer_stopped
        forks = 0

        @contextlib.contextmanager
        def stopped_before_the_second_fork():
            global forks
            forks += 1
            if forks == 2:
                signal.raise_signal(signal.SIGTERM)
            with around_fork():
                yield

        logs.writer_stopped = stopped_before_the_second_fork

        def wait_for_the_stop(index, _report_fd):
            while True:
                signal.pause()

        sys.exit(workers.supervise(3, wait_for_the_stop))
        """
    )
    assert done.returncode == 0, done.stderr
    assert "supervising 1 kvguard workers" in done.stderr  # no fork once the stop came


def test_a_stop_that_reaches_a_worker_at_its_fork_is_the_workers() -> None:
    """The second worker gets SIGTERM as it is forked: it exits 0 by its own handler, before
    it runs, and signals none of its siblings; the supervisor starts it again."""
    done = supervised(
        """
        import os, signal, sys
        from kvguard.ops import logs, workers

        logs.configure("info")
        forks = 0

        def counted():
            global forks
            forks += 1

        def stop_the_second_fork():
            if forks == 2:
                os.kill(os.getpid(), signal.SIGTERM)

        os.register_at_fork(before=counted, after_in_child=stop_the_second_fork)

        def run(index, _report_fd):
            print(f"worker {index} of fork {forks}", flush=True)
            if forks == 3:  # the worker started again stops the supervisor
                os.kill(os.getppid(), signal.SIGTERM)
            while True:
                signal.pause()

        sys.exit(workers.supervise(2, run))
        """
    )
    ran = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    assert "worker 1 of fork 2" not in ran
    assert "worker 1 of fork 3" in ran  # not worker 0, stopped by its sibling and restarted
    assert "worker 1 (pid " in done.stderr and "exited with 0; starting it again" in done.stderr


def test_a_worker_keeps_only_its_own_end_of_its_report_pipe() -> None:
    done = supervised(
        """
        import os, signal, sys
        from kvguard.ops import workers

        def ends_of(target):
            ends = 0
            for fd in os.listdir("/proc/self/fd"):
                try:
                    ends += os.readlink(f"/proc/self/fd/{fd}") == target
                except OSError:  # the listing's own descriptor, closed by now
                    pass
            return ends

        def run(index, report_fd):
            pipe = os.readlink(f"/proc/self/fd/{report_fd}")
            print(f"{pipe} {ends_of(pipe)}", flush=True)
            os.kill(os.getppid(), signal.SIGTERM)
            while True:
                signal.pause()

        sys.exit(workers.supervise(1, run, "127.0.0.1:0"))
        """
    )
    assert done.returncode == 0, done.stderr
    pipe, ends = done.stdout.split()
    assert pipe.startswith("pipe:")
    assert ends == "1"  # the write end; the read end is the supervisor's
