"""Completion latency as a JupyterLab user meets it, next to JupyterLab's 1 s limit (its default
completion provider timeout). A kernel is started and its first cell runs; then one request comes
at once, while the code analysis loads the crate graph (the kernel does that at its first idle
moment; a path seen before is answered from what was kept meanwhile), and after PAUSE seconds (a
user reading the result and typing) rounds of requests."""

import statistics
import subprocess
import sys
import time

from jupyter_client.manager import start_new_kernel

LIMIT = 1.0
PAUSE = 10
REQUESTS = ["tch::Tensor::zer", "let t = tch::Tensor::ones([2], tch::kind::FLOAT_CPU);\nt.su",
            "std::collections::HashM", "tch::nn::Lin"]


def complete(kc, code):
    start = time.perf_counter()
    msg_id = kc.complete(code, len(code))
    while True:
        reply = kc.get_shell_msg(timeout=120)
        if reply["parent_header"].get("msg_id") == msg_id:
            return time.perf_counter() - start, reply["content"]["matches"]


def main(rounds):
    km, kc = start_new_kernel(kernel_name=sys.argv[2] if len(sys.argv) > 2 else "tchmem",
                              startup_timeout=120, stderr=subprocess.DEVNULL)
    started = time.perf_counter()
    msg_id = kc.execute("1 + 1")
    while kc.get_shell_msg(timeout=900)["parent_header"].get("msg_id") != msg_id:
        pass
    print(f"first cell answered {time.perf_counter() - started:.1f} s after the kernel started")
    seconds, matches = complete(kc, REQUESTS[0])
    print(f"a request right after the first cell: {seconds:.3f} s, {len(matches)} matches "
          f"(while the analysis loads)")
    time.sleep(PAUSE)
    print(f"{'request':<28} {'round':>5} {'seconds':>8}  matches  (limit {LIMIT:.1f} s)")
    times = []
    for round_ in range(rounds):
        for code in REQUESTS:
            seconds, matches = complete(kc, code)
            times.append(seconds)
            flag = "" if seconds <= LIMIT else "  over the limit"
            label = code.replace("\n", " ")[-28:]
            print(f"{label:<28} {round_:>5} {seconds:>8.3f}  {len(matches):>7}{flag}")
    print(f"first request {times[0]:.3f} s; median {statistics.median(times):.3f} s; "
          f"slowest {max(times):.3f} s; over {LIMIT:.1f} s: {sum(t > LIMIT for t in times)} "
          f"of {len(times)}")
    kc.stop_channels()
    km.shutdown_kernel(now=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
