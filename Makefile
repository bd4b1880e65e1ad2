# The two commands of the README; each installs what it needs first. Which Python they install
# into and run: deploy/local/python.sh ($PYTHON, $VENV, the activated environment, else .venv).

# The newest torch this project is tested with: pyproject.toml declares torch>=2.13,<2.15, and
# the oldest end (2.13.0) is what deploy/local/install.sh installs where torch is missing.
TORCH_NEWEST := 2.14.1

.PHONY: demo test test-fast test-torch-newest bench

## A local elastic job: 2 torchrun agents on a bundled etcd, checkpoints and TensorBoard under runs/.
demo:
	bash deploy/local/install.sh s3,etcd
	bash deploy/local/run.sh

## The whole test suite (real etcd, real S3 API server, real torchrun agents); prints torch at the
## start and the end and fails if it changed.
test:
	bash deploy/local/test.sh

## The unit tests alone (tests/unit: no etcd, S3 server or torchrun agent), for the inner loop of a
## change; `make test` stays the whole suite.
test-fast:
	ELASTIC_DDP_TEST_SLURM=0 bash deploy/local/test.sh tests/unit

## The rendezvous and checkpoint tests (they reach into torch's elastic agent and DCP) on the
## newest torch, in a virtualenv of its own (torch 2.14.1 for Linux is a CUDA build: about 6 GB).
test-torch-newest:
	PYTHON= VENV=.venv-torch-$(TORCH_NEWEST) TORCH_VERSION=$(TORCH_NEWEST) \
		bash deploy/local/test.sh tests/*/test_rendezvous_*.py tests/*/test_checkpoint_*.py

## Every benchmark at tiny sizes (benchmarks/test_smoke.py): checks that each comparison runs and
## records its numbers, not how fast (benchmarks/run.py --out DIR measures; RESULTS.md has the numbers).
bench:
	ELASTIC_DDP_TEST_SLURM=0 bash deploy/local/test.sh benchmarks/test_smoke.py
