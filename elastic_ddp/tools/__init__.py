"""The user's shell: the ``elastic-ddp`` command (``tools/cli.py``) and what its subcommands drive —
a local etcd (``etcd_server.py``, which the tests and benchmarks also start), the checkpoint tools
(``checkpoint.py``) and a supervised TensorBoard (``tensorboard.py``). Nothing in the library's
training or agent paths imports these.
"""
