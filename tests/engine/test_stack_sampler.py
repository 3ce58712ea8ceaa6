"""The wall-clock stack sampler behind NANOVLLM_SAMPLE_STACKS: it attributes a thread's
time to the function it is in, including time spent blocked."""

import threading
import time

from nanovllm.engine.stack_sampler import StackSampler


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_time_is_attributed_to_the_busy_and_the_blocked_function(tmp_path):
    path = tmp_path / "prof"
    sampler = StackSampler(str(path), interval=0.002, write_every=0.1).start()
    released = threading.Event()
    waiter = threading.Thread(target=released.wait, name="waiter")
    waiter.start()
    spin(0.4)
    released.set()
    waiter.join()
    sampler.stop()
    report = path.read_text()
    main = report.split("== thread MainThread")[1].split("== thread")[0]
    share = float(main.split("test_stack_sampler.py:spin")[0].splitlines()[-1].split("%")[0])
    assert share > 80, main  # spinning the whole time
    assert "== thread waiter" in report
    waiting = report.split("== thread waiter")[1].split("== thread")[0]
    assert "threading.py:wait" in waiting  # blocked time counts where it is spent
