# The two commands of the README. Both install what they need first.
PYTHON ?= python3
export PYTHON

.PHONY: demo test

## A local elastic job: 2 torchrun agents on a bundled etcd, checkpoints and TensorBoard under runs/.
demo:
	bash deploy/local/install.sh s3,etcd
	bash deploy/local/run.sh

## The whole test suite (real etcd, real S3 API server, real torchrun agents).
test:
	bash deploy/local/install.sh test
	$(PYTHON) -m pytest
