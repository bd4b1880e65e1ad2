import logging
import os

import pytest

pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.etcd", "tests.fixtures.threads", "tests.fixtures.checkpoint"]

# Rendezvous handlers made inside this process (the handler's and plugin's own tests) start no
# workers, so they start no workers' template either (elastic_ddp.prestart). torchrun agents the
# tests start turn it back on (tests/helpers/job.py: env()); tests/integration/test_prestart.py tests it.
os.environ["ELASTIC_DDP_PRESTART"] = "0"


@pytest.fixture(autouse=True)
def _package_logging_as_found():
    """Undo what a test's code did to the ``elastic_ddp`` logger (``configure_logging`` stops it
    propagating), so a later test's ``caplog`` sees the package's records whatever ran before."""
    logger = logging.getLogger("elastic_ddp")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved
