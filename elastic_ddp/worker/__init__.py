"""The training worker: the process torchrun starts once per rank, which runs the user's script.

:func:`elastic_ddp.launch` enters here (``worker/launch.py``); :class:`~elastic_ddp.Run` owns the
step loop (``worker/run.py``). The worker side also holds ``data/``, ``memory/`` and ``checkpoint/``.
Nothing on the agent's side (``rendezvous/``, ``etcd/``, ``prestart/``) imports any of it: what both
sides share is in :mod:`elastic_ddp.contract` and :mod:`elastic_ddp.agent_marks`.
"""
