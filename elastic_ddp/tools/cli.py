"""The ``elastic-ddp`` console command: one subcommand per concern.

``etcd`` runs a local single-member etcd, ``ckpt`` lists, verifies and exports checkpoints,
``tensorboard`` serves the runs' event files (:mod:`elastic_ddp.tools.tensorboard`). Each subcommand
lives next to the code it drives and registers itself through ``add_parser(subparsers)``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from elastic_ddp.tools import checkpoint, etcd_server, tensorboard


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-ddp", description="Fault-tolerant elastic PyTorch DDP tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    etcd_server.add_parser(sub)
    checkpoint.add_parser(sub)
    tensorboard.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
