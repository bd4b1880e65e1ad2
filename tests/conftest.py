import logging
import os
import tempfile

import pytest

pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.etcd", "tests.fixtures.threads", "tests.fixtures.checkpoint"]

# Rendezvous handlers made inside this process (the handler's and plugin's own tests) start no
# workers, so they start no workers' template either (elastic_ddp.prestart). torchrun agents the
# tests start turn it back on (tests/helpers/job.py: env()); tests/integration/test_prestart.py tests it.
os.environ["ELASTIC_DDP_PRESTART"] = "0"


@pytest.fixture(scope="session", autouse=True)
def _temp_files_under_pytests_own_directory(tmp_path_factory):
    """Send every temp file the tests and their processes make (torchrun's ``torchelastic_*`` log
    directories, agent directories, ``mkdtemp`` scratch) under pytest's base directory, which
    ``tmp_path_retention_policy`` removes after a green run: a suite of ~1,000 tests that start
    torchrun agents otherwise leaves thousands of directories in /tmp on every run."""
    directory = str(tmp_path_factory.mktemp("tmp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", directory)
        patch.setattr(tempfile, "tempdir", directory)
        yield


@pytest.fixture(autouse=True)
def _package_logging_as_found():
    """Undo what a test's code did to the ``elastic_ddp`` logger (``configure_logging`` stops it
    propagating), so a later test's ``caplog`` sees the package's records whatever ran before."""
    logger = logging.getLogger("elastic_ddp")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved
