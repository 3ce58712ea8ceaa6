"""Where several front-end processes (`--api-server-count`) share their latency histograms:
prometheus_client's multiprocess files, in a directory named by MULTIPROC_ENV. That must be
set before prometheus_client is first imported, so this module does not import it (nor
anything that does): `nanovllm serve` calls make_metrics_dir first."""

import os
import shutil
import tempfile

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # where prometheus_client's processes share files
METRICS_DIR_PREFIX = "nanovllm-metrics-"  # the shared metrics' directory nanovllm serve makes


def make_metrics_dir() -> None:
    """A directory for the front ends' shared metrics, unless the user named one; to be
    called before prometheus_client is first imported (it reads MULTIPROC_ENV then)."""
    if not os.environ.get(MULTIPROC_ENV):
        os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix=METRICS_DIR_PREFIX)


def remove_metrics_dir() -> None:
    """The shared metrics' files, once every front end has stopped: only a directory
    `nanovllm serve` made (METRICS_DIR_PREFIX), never one the user named."""
    path = os.environ.get(MULTIPROC_ENV, "")
    if os.path.basename(path).startswith(METRICS_DIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)
