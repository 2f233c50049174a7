"""tests/ds_launch: a launch that outlives its timeout takes its rank processes down with it; a check's verdict
comes from its ranks' complete results, and from the launcher's exit status only when they are incomplete."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest
from ds_launch import run_check_script, run_deepspeed


def test_timeout_kills_the_launcher_and_its_children(tmp_path):
    # a stand-in launcher that starts a "rank" (a long sleep in the background) and waits for it, like
    # DeepSpeed's launcher does; the rank's pid is written down so the test can look for it afterwards
    pidfile = tmp_path / "rank.pid"
    launcher = tmp_path / "fake-deepspeed"
    launcher.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    launcher.chmod(0o755)
    t0 = time.monotonic()
    proc = run_deepspeed("no_such_script.py", [], world=1, cwd=tmp_path, timeout=2, launcher=launcher)
    assert time.monotonic() - t0 < 30
    assert proc.returncode == -9
    assert "killed after 2 s" in proc.stderr
    rank = int(pidfile.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; reaping by init may take a moment
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{rank}/stat") as f:  # a zombie waiting for init counts as gone
            if f.read().split(")")[-1].split()[0] == "Z":
                break
        time.sleep(0.1)
    else:
        raise AssertionError(f"rank process {rank} outlived the timeout")


_FAKE_LAUNCHER = """#!{python}
# stands in for `deepspeed --num_gpus W --master_port P SCRIPT --result RESULT PAIR...`: writes what the check's
# ranks would write (as told by the test), then exits with the status the test asks for
import json, sys
argv = sys.argv[1:]
world, result = int(argv[argv.index("--num_gpus") + 1]), argv[argv.index("--result") + 1]
pairs = argv[argv.index("--result") + 2:]
spec = json.load(open({spec!r}))
if spec["write_results"]:
    json.dump([dict(fixture=p.split("=")[0], ckpt=p.split("=")[1], world_size=world, ok=p not in spec["fail"],
                    problems=[] if p not in spec["fail"] else ["rank 0: broken"]) for p in pairs[:spec["n_results"]]],
              open(result, "w"))
for r in range(world):
    if r not in spec["dead_ranks"]:
        open(f"{{result}}.rank{{r}}.done", "w").write(str(world))
print("PASS" if not spec["fail"] else "FAIL")
sys.exit(spec["exit"])
"""

VERDICT_CASES = {
    # the teardown crash: every rank reported, every check passed, then the launcher exits 250
    "teardown_crash_after_complete_results": (dict(exit=250), 0, "exited 250 after every rank had reported"),
    "a_failed_check_is_1_whatever_the_launcher_says": (dict(exit=250, fail=["a=x"]), 1, "verdict (1)"),
    "a_rank_without_its_marker_keeps_the_launcher_status": (dict(exit=250, dead_ranks=[1]), 250, None),
    "no_results_keeps_the_launcher_status": (dict(exit=250, write_results=False), 250, None),
    "results_for_fewer_pairs_keep_the_launcher_status": (dict(exit=250, n_results=1), 250, None),
    "incomplete_but_exit_0_fails": (dict(exit=0, dead_ranks=[0]), -1, "results are incomplete"),
    "clean_run": (dict(exit=0), 0, None),
}


@pytest.mark.parametrize("case", sorted(VERDICT_CASES))
def test_verdict_comes_from_complete_results_else_from_the_launcher(tmp_path, case):
    spec, want, note = VERDICT_CASES[case]
    spec = {"write_results": True, "n_results": 2, "fail": [], "dead_ranks": [], **spec}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    launcher = tmp_path / "fake-deepspeed"
    launcher.write_text(_FAKE_LAUNCHER.format(python=sys.executable, spec=str(tmp_path / "spec.json")))
    launcher.chmod(0o755)
    verdict, results, log = run_check_script("no_such_script.py", ["a=x", "b=y"], world=2, cwd=tmp_path, timeout=60,
                                             launcher=launcher)
    assert verdict == want, log
    assert len(results) == (spec["n_results"] if spec["write_results"] else 0)
    if note:
        assert note in log, log
    else:
        assert "[ds_launch]" not in log, log


@pytest.mark.parametrize("taken_times, want_rc", [(1, 0), (2, 1)], ids=["taken_once", "taken_twice"])
def test_a_taken_master_port_is_retried_once_and_only_once(tmp_path, taken_times, want_rc):
    # a launcher whose rendezvous fails with torch's EADDRINUSE error the first `taken_times` times it is started
    count = tmp_path / "starts"
    launcher = tmp_path / "fake-deepspeed"
    launcher.write_text(f"""#!/bin/sh
echo x >> {count}
if [ $(wc -l < {count}) -le {taken_times} ]; then
  echo "The server socket has failed to listen on any local network address. port: 1, code: -98, name: EADDRINUSE" >&2
  exit 1
fi
exit 0
""")
    launcher.chmod(0o755)
    proc = run_deepspeed("no_such_script.py", [], world=1, cwd=tmp_path, timeout=30, launcher=launcher)
    assert proc.returncode == want_rc, proc.stderr
    assert count.read_text().count("x") == 2  # never a third start
    assert "retried once on a new port" in proc.stderr
