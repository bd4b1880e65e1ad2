import logging

import pytest

pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.etcd"]


@pytest.fixture(autouse=True)
def _package_logging_as_found():
    """Undo what a test's code did to the ``elastic_ddp`` logger (``configure_logging`` stops it
    propagating), so a later test's ``caplog`` sees the package's records whatever ran before."""
    logger = logging.getLogger("elastic_ddp")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved
