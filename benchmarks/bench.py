"""Wall-time ratios of paracheck's modes, measured with real gloo runs (no timed assertions anywhere).

    python benchmarks/bench.py [--repeat N]

Reports each mode's wall time relative to a forward-only run of the same cases, and what a launch per
case would cost against one launch for all of them.
"""

import argparse
import statistics
import subprocess
import sys
import time

CASES = ["--models", "flux,qwenimage", "--layouts", "tp4,u4,tp2xu2"]
MODES = {
    "forward only (--no-grads)": CASES + ["--no-grads"],
    "forward + grads (default)": CASES,
    "forward + grads + --controls": CASES + ["--controls"],
}


def timed(args: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "paracheck", "run", *args], capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"paracheck {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=1)
    repeat = parser.parse_args().repeat
    times = {name: statistics.median(timed(args) for _ in range(repeat)) for name, args in MODES.items()}
    one_case = statistics.median(timed(["--models", "flux", "--layouts", "tp2xu2", "--no-grads"]) for _ in range(repeat))
    base = times["forward only (--no-grads)"]
    print(f"{'mode':34} {'seconds':>8} {'vs forward only':>16}")
    for name, seconds in times.items():
        print(f"{name:34} {seconds:8.1f} {seconds / base:15.2f}x")
    n = 6  # flux, qwenimage x tp4, u4, tp2xu2
    print(f"\none launch, one case: {one_case:.1f}s; a launch per case for the {n} forward-only cases would take "
          f"about {n * one_case:.0f}s, {n * one_case / base:.1f}x the single launch")


if __name__ == "__main__":
    main()
